"""What `isoexec pair` runs an arm with, and what it refuses before anything starts.

`PairRun` is one run's settings, built once (from the CLI's arguments or by a caller) and read
by the arms, the report and the checks, instead of a dozen loose parameters. `check_setup`
refuses a trainer device / kernel backend that cannot work on this machine, with the reason;
`arm_settings` gives one arm's trainer options and engine config from one `IsoExecOptions`, so
both sides of an arm run the same backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICES = ("cpu", "cuda")  # where the trainer runs (`megatron_parallel(device=)`)
BACKENDS = ("torch", "triton")  # `IsoExecOptions.backend` (`isoexec.ops.BACKENDS`)


@dataclass(frozen=True)
class PairRun:
    """One `isoexec pair` run: the model, what is sampled, both sides' layouts and kernels."""

    model_dir: str
    dtype: str = "float32"
    num_prompts: int = 6
    max_tokens: int = 8
    seed: int = 0
    engine_tp: int = 1  # vLLM's executor; above 1 the isoexec arm runs tp_invariant
    trainer_tp: int = 1  # a torchrun world of trainer_tp x trainer_pp ranks above 1
    trainer_pp: int = 1
    backend: str = "torch"  # the isoexec arm's kernels on both sides
    device: str = "cpu"  # where the trainer runs
    lora: str | None = None  # a PEFT adapter directory: every prompt sampled under it
    locate: bool = False  # trace an isoexec arm that is not 100% bitwise (into out/locate)
    out: Path | None = None  # where engine logs and traces go
    verbose: bool = False  # the engines' and the trainer's own logs on the console

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_tp * self.trainer_pp

    @property
    def locate_dir(self) -> Path | None:
        return None if not self.locate or self.out is None else self.out / "locate"

    def engine_log(self, arm: str) -> str | None:
        """Where the arm's engine writes its log (None: on the console)."""
        return None if self.verbose or self.out is None else str(self.out / f"engine-{arm}.log")

    @classmethod
    def from_args(cls, args: Any, model_dir: str) -> PairRun:
        """The run the `isoexec pair` CLI's parsed arguments ask for."""
        return cls(
            model_dir=model_dir, dtype=args.dtype, num_prompts=args.num_prompts,
            max_tokens=args.max_tokens, seed=args.seed, engine_tp=args.engine_tp,
            trainer_tp=args.trainer_tp, trainer_pp=args.trainer_pp, backend=args.backend,
            device=args.device, lora=args.lora, locate=args.locate, out=Path(args.out),
            verbose=args.verbose,
        )  # fmt: skip


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


def arm_settings(run: PairRun, *, isoexec: bool, lora_rank: int | None = None) -> tuple[Any, Any]:
    """(the trainer's `IsoExecOptions`, the engine's `EngineConfig` holding the same options)
    for one arm of `run`. The isoexec arm runs the run's backend on both sides (and
    `tp_invariant` with a TP above 1, the only canonical form across TP degrees); the stock arm
    is stock on both sides, whatever the backend. `--locate` traces the engine per site: its
    module hooks need eager mode (compiled and eager engines compute the same bits,
    tests/vllm/test_compiled_engine.py). `lora_rank`: the engine's max_lora_rank (LoRA on)."""
    from isoexec.contract.options import IsoExecOptions
    from isoexec.vllm.engine_process import EngineConfig

    options = IsoExecOptions(
        tp_invariant=isoexec and max(run.engine_tp, run.trainer_tp) > 1,
        backend=run.backend if isoexec else "torch",
    )
    arm = "isoexec" if isoexec else "stock"
    engine_cfg = EngineConfig(
        model=run.model_dir, dtype=run.dtype, isoexec=isoexec, seed=run.seed,
        max_num_batched_tokens=128, options=options, tensor_parallel_size=run.engine_tp,
        enforce_eager=run.locate, log_file=run.engine_log(arm),
        lora=None if lora_rank is None else (lora_rank, 1),
    )  # fmt: skip
    return options, engine_cfg


__all__ = ["BACKENDS", "DEVICES", "PairRun", "PairSetupError", "arm_settings", "check_setup"]
