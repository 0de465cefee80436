"""What `isoexec pair` runs an arm with, and what it refuses before anything starts.

`check_setup` refuses a trainer device / kernel backend that cannot work on this machine, with
the reason; `arm_settings` gives one arm's trainer options and engine config from one
`IsoExecOptions`, so both sides of an arm run the same backend.
"""

from __future__ import annotations

import os
from typing import Any

DEVICES = ("cpu", "cuda")  # where the trainer runs (`megatron_parallel(device=)`)
BACKENDS = ("torch", "triton")  # `IsoExecOptions.backend` (`isoexec.contract.ops.BACKENDS`)


class PairSetupError(ValueError):
    """A device / backend combination `isoexec pair` cannot run; said before anything starts."""


def check_setup(device: str, backend: str, *, trainer_ranks: int = 1) -> None:
    """Refuse a trainer `device` and kernel `backend` that cannot work here, with the reason:
    CUDA asked for but absent (or fewer devices than trainer ranks); the CPU trainer on a
    machine with CUDA (its CPU shims refuse a CUDA process); Triton on the CPU outside
    Triton's interpreter (TRITON_INTERPRET=1), or without triton installed."""
    import importlib.util

    import torch

    if device not in DEVICES:
        raise PairSetupError(f"--device {device!r}: known {list(DEVICES)}")
    if backend not in BACKENDS:
        raise PairSetupError(f"--backend {backend!r}: known {list(BACKENDS)}")
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise PairSetupError("--backend triton: triton is not installed")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise PairSetupError(
                f"--device cuda: CUDA is not available (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda or 'none'}); run on a GPU machine or use --device cpu"
            )
        count = torch.cuda.device_count()
        if trainer_ranks > count:
            raise PairSetupError(
                f"--device cuda: a trainer of {trainer_ranks} ranks needs one CUDA device per "
                f"rank; {count} visible"
            )
        return
    if torch.cuda.is_available():
        raise PairSetupError(
            "--device cpu on a machine with CUDA: the CPU trainer's shims refuse a CUDA process "
            "(they would move Megatron's CUDA buffers to the CPU); use --device cuda"
        )
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PairSetupError(
            "--backend triton --device cpu runs only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 (slow; it proves the kernels' structure, not GPU bits), or use "
            "--device cuda"
        )


def arm_settings(
    model_dir: str,
    dtype: str,
    *,
    isoexec: bool,
    seed: int,
    backend: str = "torch",
    engine_tp: int = 1,
    trainer_tp: int = 1,
    eager: bool = False,
    log_file: str | None = None,
) -> tuple[Any, Any]:
    """(the trainer's `IsoExecOptions`, the engine's `EngineConfig` holding the same options)
    for one arm. The isoexec arm runs `backend` on both sides (and `tp_invariant` with a TP
    above 1, the only canonical form across TP degrees); the stock arm is stock on both sides,
    whatever the backend."""
    from isoexec.contract.options import IsoExecOptions
    from isoexec.vllm.engine_process import EngineConfig

    options = IsoExecOptions(
        tp_invariant=isoexec and max(engine_tp, trainer_tp) > 1,
        backend=backend if isoexec else "torch",
    )
    engine_cfg = EngineConfig(
        model=model_dir, dtype=dtype, isoexec=isoexec, seed=seed, max_num_batched_tokens=128,
        options=options, tensor_parallel_size=engine_tp, enforce_eager=eager, log_file=log_file,
    )  # fmt: skip
    return options, engine_cfg


__all__ = ["BACKENDS", "DEVICES", "PairSetupError", "arm_settings", "check_setup"]
