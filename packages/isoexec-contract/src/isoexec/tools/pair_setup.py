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

from isoexec.ops.penalties import Penalties
from isoexec.ops.truncation import Truncation

DEVICES = ("cpu", "cuda")  # where the trainer runs (`megatron_parallel(device=)`)
BACKENDS = ("torch", "triton")  # `IsoExecOptions.backend` (`isoexec.ops.BACKENDS`)
# isoexec: IsoExec on both sides. stock: both sides as upstream ships them. upstream-bi: both
# sides in upstream's own batch-invariant modes (vLLM's VLLM_BATCH_INVARIANT=1, Megatron-core's
# batch_invariant_mode), the arm IsoExec is measured against.
ARMS = ("isoexec", "stock", "upstream-bi")
# On CUDA the engine and the trainer share one GPU: the engine may claim this share at start
# (vLLM's own default, 0.9, would refuse to start beside the trainer or the last family's).
ENGINE_GPU_SHARE = 0.3
UPSTREAM_BI_ENV = (("VLLM_BATCH_INVARIANT", "1"),)


def _truncation(args: Any) -> Truncation | None:
    cut = Truncation(getattr(args, "top_k", 0), getattr(args, "top_p", 1.0),
                     getattr(args, "min_p", 0.0))  # fmt: skip
    return cut if cut.active else None


def _penalties(args: Any) -> Penalties | None:
    pen = Penalties.of(getattr(args, "repetition_penalty", 1.0),
                       getattr(args, "frequency_penalty", 0.0),
                       getattr(args, "presence_penalty", 0.0),
                       getattr(args, "logit_bias", None))  # fmt: skip
    return pen if pen.active else None


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
    truncation: Truncation | None = None  # top-k/top-p/min-p every prompt is sampled with
    penalties: Penalties | None = None  # penalties and logit bias every prompt is sampled with
    full_vocab: bool = False  # compare whole processed rows too (the engine: max_logprobs=-1)

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
            verbose=args.verbose, truncation=_truncation(args),
            penalties=_penalties(args),
            full_vocab=getattr(args, "full_vocab", False),
        )  # fmt: skip


class PairSetupError(ValueError):
    """A device / backend combination `isoexec pair` cannot run; said before anything starts."""


def check_arms(arms: list[str], run: PairRun) -> None:
    """Refuse an arm `isoexec pair` does not know (never run it as another), the upstream-bi
    arm where upstream's modes cannot run, and --full-vocab with a torchrun trainer, with the
    reason."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise PairSetupError(f"--arms {','.join(arms)!r}: known arms {', '.join(ARMS)}")
    if run.full_vocab and run.trainer_ranks > 1:
        raise PairSetupError("--full-vocab scores on the in-process trainer (--trainer-tp/-pp 1)")
    if "upstream-bi" not in arms:
        return
    if run.device != "cuda":
        raise PairSetupError(
            "--arms upstream-bi needs --device cuda: Megatron-core's batch_invariant_mode "
            "kernels are CUDA-only (they assert CUDA tensors) and vLLM's VLLM_BATCH_INVARIANT "
            "replaces CUDA kernels; on CPU there is no upstream batch-invariant arm to run"
        )
    if run.trainer_ranks > 1 or run.lora is not None or run.locate:
        raise PairSetupError(
            "--arms upstream-bi runs the in-process trainer without LoRA or --locate "
            "(--trainer-tp/-pp 1)"
        )


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
    run: PairRun, *, isoexec: bool, lora_rank: int | None = None, upstream_bi: bool = False
) -> tuple[Any, Any]:
    """(the trainer's `IsoExecOptions`, the engine's `EngineConfig` holding the same options)
    for one arm of `run`. The isoexec arm runs the run's backend on both sides (and
    `tp_invariant` with a TP above 1, the only canonical form across TP degrees); the stock arm
    is stock on both sides, whatever the backend; `upstream_bi` is the stock arm with vLLM's
    batch-invariant mode on in the engine's environment. `--locate` traces the engine per site: its
    module hooks need eager mode (compiled and eager engines compute the same bits,
    tests/vllm/test_compiled_engine.py). `lora_rank`: the engine's max_lora_rank (LoRA on)."""
    from isoexec.contract.options import IsoExecOptions
    from isoexec.vllm.engine_process import EngineConfig

    if isoexec and upstream_bi:
        raise ValueError("arm_settings: upstream_bi is a stock arm (isoexec=False)")
    options = IsoExecOptions(
        tp_invariant=isoexec and max(run.engine_tp, run.trainer_tp) > 1,
        backend=run.backend if isoexec else "torch",
    )
    arm = "isoexec" if isoexec else ("upstream-bi" if upstream_bi else "stock")
    engine_cfg = EngineConfig(
        model=run.model_dir, dtype=run.dtype, isoexec=isoexec, seed=run.seed,
        max_num_batched_tokens=128, options=options, tensor_parallel_size=run.engine_tp,
        enforce_eager=run.locate, log_file=run.engine_log(arm),
        lora=None if lora_rank is None else (lora_rank, 1),
        extra_env=UPSTREAM_BI_ENV if upstream_bi else (),
        gpu_memory_utilization=ENGINE_GPU_SHARE if run.device == "cuda" else None,
        max_logprobs=-1 if run.full_vocab else None,
    )  # fmt: skip
    return options, engine_cfg


def free_device_memory(device: str) -> None:
    """After an arm on CUDA: give the trainer's cached blocks back to the driver, so the next
    arm's engine finds the memory free (its engine has shut down already: `EngineProcess`
    closes and waits for its process group)."""
    if device == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def trainer_mode(upstream_bi: bool) -> Any:
    """Megatron-core's own batch-invariant mode around the upstream-bi arm's scoring."""
    import contextlib

    if not upstream_bi:
        return contextlib.nullcontext()
    from isoexec.megatron.upstream_bi import megatron_batch_invariant_mode

    return megatron_batch_invariant_mode()


__all__ = [
    "ARMS",
    "BACKENDS",
    "DEVICES",
    "ENGINE_GPU_SHARE",
    "PairRun",
    "PairSetupError",
    "arm_settings",
    "check_arms",
    "check_setup",
    "free_device_memory",
    "trainer_mode",
]
