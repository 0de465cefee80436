"""What `isoexec bench` runs with, and what it refuses before anything starts.

`BenchRun` is one benchmark's settings, built once (from the CLI's arguments, or by a caller)
and read by the engine and trainer measurements and by the report (`settings()` is the
report's "settings" section), instead of loose parameters passed from function to function.
Building one validates it: a family, size, mode, dtype or rep count the benchmark cannot run
is a `BenchSetupError` naming it, before any model is made or engine started.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isoexec.tools.tiny_models import QWEN35_35B_A3B_TEXT

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 128, "layers": 2, "vocab": 1024, "prompts": 2, "tokens": 8},
    "small": {"hidden": 512, "layers": 4, "vocab": 8192, "prompts": 8, "tokens": 32},
    "medium": {"hidden": 768, "layers": 8, "vocab": 32768, "prompts": 32, "tokens": 128},
    # Qwen3-0.6B's widths and vocabulary, random weights: the size users run, where the lm
    # head and the logprobs over 151,936 tokens cost the most.
    "qwen3-0.6b": {"hidden": 1024, "layers": 28, "vocab": 151936, "prompts": 4, "tokens": 16},
    # Qwen3.5-35B-A3B's real widths (256 experts of 512, top-8, head_dim 256, 16/32 GDN heads)
    # and its 248,320-token vocabulary, two layers (one GDN, one gated attention): 2.7B
    # parameters, 5.4 GB in bf16, per engine.
    "qwen3.5-35b-a3b-slice": dict(hidden=2048, layers=2, vocab=248320, prompts=2, tokens=8),
}
# The checkpoint architecture of a size that is not the family's own (`tiny_models` preset),
# and the families such a size can run.
SIZE_PRESETS: dict[str, str] = {"qwen3.5-35b-a3b-slice": "tiny-qwen35-moe-text"}
SIZE_FAMILIES: dict[str, tuple[str, ...]] = {"qwen3.5-35b-a3b-slice": ("gdn",)}
# Config fields a size sets over `make_model`'s own (heads from the width, MLP 3x hidden):
# the released model's. Its MoE and GDN families keep the bench's expert and GDN structure.
SIZE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "qwen3.5-35b-a3b-slice": {**QWEN35_35B_A3B_TEXT, "vocab_size": 248320},
}
FAMILIES = ("dense", "moe", "gdn")
MODES = {"default": ("default",), "eager": ("eager",), "both": ("default", "eager")}
DTYPES = ("float32", "bfloat16")
PROMPT_LEN = 32
DEFAULT_OUT = "isoexec-bench"


def available_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


# The engines' max_model_len (`EngineConfig`'s default): vLLM refuses a KV cache smaller than
# one sequence of this length.
ENGINE_MAX_LEN = 512


def kv_cache_bytes(prompts: int, tokens: int, per_token: int = 2**16) -> int:
    """KV for every sequence at once (the tests' small default would preempt at the medium
    size), and at least two sequences of the engine's full length: 64 KiB per token covers
    the small models; `per_token` for wider ones."""
    per_token = max(per_token, 2**16)
    return max(128 * 2**20, prompts * (PROMPT_LEN + tokens) * per_token,
               2 * ENGINE_MAX_LEN * per_token)  # fmt: skip


def kv_bytes_per_token(model: Path) -> int:
    """fp32 K and V of every layer for one token of the checkpoint at `model` (an upper bound:
    GDN layers keep a state, not a cache)."""
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * 4


class BenchSetupError(ValueError):
    """A benchmark that cannot run as asked (refused before anything starts)."""


def resolve_dtype(family: str, dtype: str | None) -> str:
    """The dtype to run: as asked, else float32 (bfloat16 for GDN); GDN refuses float32."""
    if family not in FAMILIES:
        raise BenchSetupError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    if dtype is not None and dtype not in DTYPES:
        raise BenchSetupError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    chosen = dtype or ("bfloat16" if family == "gdn" else "float32")
    if family == "gdn" and chosen != "bfloat16":
        raise BenchSetupError(
            "--family gdn runs in bfloat16 only: stock vLLM-CPU's GDN kernel (the native arm) "
            "takes bf16 and GDN head dims 64/128; drop --dtype or pass --dtype bfloat16"
        )
    return chosen


@dataclass(frozen=True)
class BenchRun:
    """One `isoexec bench` run. `dtype` None resolves to the family's default on building."""

    family: str = "dense"
    size: str = "small"
    dtype: str | None = None
    reps: int = 3
    mode: str = "default"  # a key of `MODES`: the engine modes both arms run in
    trainer: bool = True  # also time the trainer (never with `lora`: the engine only)
    lora: bool = False  # both engine arms generate under a rank-8 adapter (dense only)
    speculative: int = 0  # both engine arms speculate with n-gram drafts of this many tokens
    threads: int | None = None  # CPU threads of every engine and the trainer (None: defaults)
    out: Path = field(default_factory=lambda: Path(DEFAULT_OUT))
    verbose: bool = False  # the engines' and the trainer's own logs on the console

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", resolve_dtype(self.family, self.dtype))
        if self.size not in SIZES:
            raise BenchSetupError(f"unknown size {self.size!r}; known: {', '.join(SIZES)}")
        if self.family not in SIZE_FAMILIES.get(self.size, FAMILIES):
            runs = ", ".join(SIZE_FAMILIES[self.size])
            raise BenchSetupError(
                f"--size {self.size} is {SIZE_PRESETS[self.size]}'s architecture: --family {runs}"
            )
        if self.mode not in MODES:
            raise BenchSetupError(f"unknown mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.reps < 1:
            raise BenchSetupError(f"--reps {self.reps}: at least 1")
        if self.lora and self.family != "dense":
            raise BenchSetupError("--lora runs on the dense family only (LoRA on MoE is refused)")
        if self.threads is not None:
            cpus = available_cpus()
            if not 1 <= self.threads <= len(cpus):
                raise BenchSetupError(
                    f"--threads {self.threads}: this process may use {len(cpus)} CPUs {cpus}"
                )
        if self.speculative < 0:
            raise BenchSetupError(f"--speculative {self.speculative}: 0 (off) or more drafts")
        if self.speculative and (self.lora or self.family == "gdn"):
            raise BenchSetupError("--speculative runs dense and MoE without --lora (IsoExec's "
                                  "GDN layer and LoRA engines refuse speculation)")  # fmt: skip
        if self.lora and self.trainer:
            object.__setattr__(self, "trainer", False)  # the adapter is timed on the engine

    @property
    def shape(self) -> dict[str, int]:
        """The model and batch of this size: hidden, layers, vocab, prompts, tokens."""
        return SIZES[self.size]

    @property
    def config(self) -> dict[str, Any]:
        """Config fields of this size's model beyond `shape` (a released model's widths)."""
        return dict(SIZE_CONFIGS.get(self.size, {}))

    @property
    def preset(self) -> str | None:
        """The `tiny_models` preset of this size's checkpoint (None: the family's own)."""
        return SIZE_PRESETS.get(self.size)

    def engine_env(self) -> tuple[tuple[str, str], ...]:
        """The environment that gives an engine `threads` threads: vLLM-CPU binds one OpenMP
        thread per CPU listed in VLLM_CPU_OMP_THREADS_BIND."""
        if self.threads is None:
            return ()
        cpus = ",".join(map(str, available_cpus()[: self.threads]))
        return (("OMP_NUM_THREADS", str(self.threads)), ("VLLM_CPU_OMP_THREADS_BIND", cpus))

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES[self.mode]

    def engine_log(self, arm: str, mode: str) -> str | None:
        """Where an arm's engine writes its log (None: on the console)."""
        return None if self.verbose else str(self.out / f"engine-{arm}-{mode}.log")

    def settings(self) -> dict[str, Any]:
        """The report's "settings" section (`bench.json`)."""
        return {
            "family": self.family, "size": self.size, "dtype": self.dtype, "reps": self.reps,
            "mode": self.mode, "modes": list(self.modes), "trainer": self.trainer,
            "prompt_len": PROMPT_LEN, "lora": self.lora, "speculative": self.speculative,
            "threads": self.threads, **self.shape, **self.config,
        }  # fmt: skip

    @classmethod
    def from_args(cls, args: Any) -> BenchRun:
        """The run the `isoexec bench` CLI's parsed arguments ask for."""
        return cls(
            family=args.family, size=args.size, dtype=args.dtype, reps=args.reps,
            mode=args.mode, trainer=not args.no_trainer, lora=args.lora, out=Path(args.out),
            verbose=args.verbose, speculative=args.speculative, threads=args.threads,
        )  # fmt: skip


__all__ = [
    "DEFAULT_OUT",
    "DTYPES",
    "FAMILIES",
    "MODES",
    "PROMPT_LEN",
    "SIZES",
    "SIZE_CONFIGS",
    "SIZE_FAMILIES",
    "SIZE_PRESETS",
    "BenchRun",
    "BenchSetupError",
    "available_cpus",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "resolve_dtype",
]
