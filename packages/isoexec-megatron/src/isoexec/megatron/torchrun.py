"""Launch a trainer on a real `torchrun` world (gloo on CPU, NCCL on CUDA: the ranks choose,
see `parallel.megatron_parallel`) that can never outlive the caller.

torchrun and its ranks run in their own session and are killed as a group whatever happens
(success, failure, timeout, interrupt), so no rank is left behind on a shared machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence


class TorchrunError(RuntimeError):
    """The torchrun world failed; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun(
    target: Sequence[str],
    nproc: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900.0,
) -> str:
    """Run `torchrun --nproc-per-node nproc TARGET...` on loopback; return its log.

    `target` is a script and its arguments, or `["-m", module, args...]`. One OpenMP thread per
    rank unless `env` says otherwise (the ranks share the machine's cores).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", *target,
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.decode(errors="replace")
    if proc.returncode != 0:
        raise TorchrunError(f"torchrun exited {proc.returncode}:\n{text[-6000:]}")
    return text


__all__ = ["TorchrunError", "free_port", "run_torchrun"]
