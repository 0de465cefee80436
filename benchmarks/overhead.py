"""IsoExec vs native overhead, side by side, measured in one run (alternating, medians).

Engine: generation throughput (tokens/s) of a real vLLM with IsoExec on vs off, both engines
alive at once and called in alternation so machine drift hits both arms alike. Trainer:
forward+backward time per token of a real Megatron model, IsoExec vs native, alternating.
Then a per-op profile of the IsoExec trainer forward (time inside each canonical op).

    python benchmarks/overhead.py [--family dense|moe] [--hidden 512 --layers 4 --vocab 8192]
                                  [--out bench.json]

The issue's target size (hidden 768-1024, 8-12 layers, vocab 32k, 32 prompts x 128 tokens)
runs with flags; the defaults are sized for the 2-core CI machine. A GDN variant is not offered:
stock vLLM-CPU runs GDN only in bf16 with head dims 64/128, so the engine has no native arm to
compare against on a CPU machine (the trainer has one: Megatron-core's own GatedDeltaNet, run
on the CPU through `isoexec.megatron.cpu_shims`).
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


def make_model(out: Path, hidden: int, layers: int, vocab: int, family: str = "dense") -> Path:
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
    if family == "moe":  # Qwen3-MoE-like: 8 experts, top-2, expert width hidden / 2
        overrides.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    elif family != "dense":
        raise ValueError(f"family {family!r}: dense or moe (GDN has no native vLLM-CPU arm)")
    preset = {"dense": "tiny-dense", "moe": "tiny-moe"}[family]
    return make_tiny_model(preset, out, overrides=overrides)


def bench_engine(model: Path, prompts: int, tokens: int, reps: int) -> dict[str, Any]:
    from isoexec.vllm.engine_process import EngineConfig, EngineProcess, SamplingSpec

    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(1000, (32,), generator=gen).tolist() for _ in range(prompts)]
    spec = SamplingSpec(max_tokens=tokens, temperature=1.0)
    times: dict[str, list[float]] = {"isoexec": [], "native": []}
    with (
        EngineProcess(EngineConfig(model=str(model), isoexec=True)) as iso,
        EngineProcess(EngineConfig(model=str(model), isoexec=False)) as nat,
    ):
        for eng in (iso, nat):  # warm-up
            eng.generate(batch[:2], SamplingSpec(max_tokens=4))
        for _ in range(reps):
            for name, eng in (("isoexec", iso), ("native", nat)):
                eng.call("reset_prefix_cache")
                t = time.perf_counter()
                eng.generate(batch, spec)
                times[name].append(time.perf_counter() - t)
    n = prompts * tokens
    tps = {k: n / statistics.median(v) for k, v in times.items()}
    return {"tokens_per_s": tps, "ratio": tps["native"] / tps["isoexec"], "runs": times}


def bench_trainer(model_dir: Path, seqs: int, seq_len: int, reps: int) -> dict[str, Any]:
    from isoexec.megatron import build_model, load_hf_weights, megatron_parallel, policy_logprobs

    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(1000, (seq_len,), generator=gen) for _ in range(seqs)]
    times: dict[str, list[float]] = {"isoexec": [], "native": []}
    profile: dict[str, float] = {}
    with megatron_parallel():
        models = {}
        for name in times:
            models[name] = build_model(str(model_dir), isoexec=name == "isoexec")
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
    n = seqs * (seq_len - 1)
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
    ap.add_argument("--family", choices=["dense", "moe"], default="dense")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench-overhead.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab, args.family)
        engine = bench_engine(model, args.prompts, args.tokens, args.reps)
        trainer = bench_trainer(model, args.seqs, args.seq_len, args.reps)
    result = {"settings": vars(args), "engine": engine, "trainer": trainer}
    Path(args.out).write_text(json.dumps(result, indent=2))
    e, t = engine["tokens_per_s"], trainer["s_per_token"]
    print(
        f"engine generation  isoexec {e['isoexec']:.1f} tok/s  native {e['native']:.1f} tok/s  "
        f"overhead {engine['ratio']:.2f}x"
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
