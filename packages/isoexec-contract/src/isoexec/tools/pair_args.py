"""The `isoexec pair` command line: its arguments, and the run they ask for (`PairRun`)."""

from __future__ import annotations

import argparse
from typing import Any

from isoexec.tools.pair_setup import BACKENDS, DEVICES

PRESETS = ("tiny-dense", "tiny-moe", "tiny-gdn", "tiny-qwen35", "tiny-qwen35-moe", "tiny-qwen35-vl",
           "tiny-qwen35-moe-text", "tiny-dense-lora")  # fmt: skip


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("pair", help="trainer vs engine, bitwise, IsoExec on and off")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face checkpoint directory")
    src.add_argument("--preset", choices=PRESETS, default="tiny-dense")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/pair", help="where the model and results go")
    p.add_argument(
        "--arms",
        default="isoexec,stock",
        help="comma list of isoexec, stock, upstream-bi (vLLM's and Megatron's own "
        "batch-invariant modes; CUDA only)",
    )
    p.add_argument(
        "--engine-tp",
        type=int,
        default=1,
        help="the engine's tensor-parallel degree (vLLM's executor); above 1 the isoexec arm "
        "runs tp_invariant on both sides",
    )
    p.add_argument(
        "--trainer-tp",
        type=int,
        default=1,
        help="the trainer's tensor-parallel degree (a torchrun world of that many ranks, each "
        "offering its own contract); above 1 the isoexec arm runs tp_invariant on both sides",
    )
    p.add_argument(
        "--trainer-pp",
        type=int,
        default=1,
        help="the trainer's pipeline-parallel degree (Megatron's schedule; the torchrun world "
        "has trainer-tp x trainer-pp ranks)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="torch",
        help="the isoexec arm's canonical kernels, on both sides (trainer and engine options); "
        "triton needs --device cuda, or TRITON_INTERPRET=1 on the CPU",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the trainer is built and runs (cpu: gloo; cuda: NCCL, one GPU per trainer "
        "rank); use the device of the engine's vLLM build",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the engines' and the trainer's own logs (quiet by default; errors always show)",
    )
    p.add_argument(
        "--lora",
        metavar="ADAPTER_DIR",
        help="a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors): the "
        "isoexec arm samples and scores every prompt under it (preset tiny-dense-lora makes one)",
    )
    p.add_argument(
        "--locate",
        action="store_true",
        help="if the isoexec arm is not 100%% bitwise, trace both sides and print the first "
        "divergent site (traces in OUT/locate/)",
    )
    add_truncation_args(p)
    return p


def _bias_map(text: str) -> dict[int, float]:
    import json

    try:
        raw = json.loads(text)
        return {int(k): min(100.0, max(-100.0, float(v))) for k, v in raw.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"--logit-bias {text!r}: {e}") from None


def add_truncation_args(p: argparse.ArgumentParser) -> None:
    """--top-k/--top-p/--min-p: every prompt is sampled with them and scored with them."""
    g = p.add_argument_group("truncated sampling (canonical on both sides: docs/ops.md)")
    g.add_argument("--top-k", type=int, default=0, help="top-k (0 or -1: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="top-p (1.0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p (0.0: off)")
    g = p.add_argument_group("penalties and logit bias (canonical on both sides: docs/ops.md)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="(1.0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="(0.0: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="(0.0: off)")
    g.add_argument(
        "--logit-bias", type=_bias_map, default=None, metavar="JSON",
        help='a JSON map of token id to bias, e.g. \'{"5": 2.0}\' (vLLM clamps to [-100, 100])',
    )  # fmt: skip
    p.add_argument(
        "--full-vocab",
        action="store_true",
        help="also compare each sampled position's whole processed logprob row, trainer "
        "against engine (vLLM's logprobs=-1): rows bitwise and max |Δ| over all entries",
    )
