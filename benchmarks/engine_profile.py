"""Where a vLLM engine's generation time goes, IsoExec vs native: exclusive time per module class.

Each arm runs in its own process (ISOEXEC decides what vLLM registers at import), with the
engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so forward hooks on the live model can
time every module: a class's *exclusive* time is its forward minus its children's, so the rows
add up to the model forward and the two arms compare site kind by site kind (the attention
layer, each linear class, the MoE layer, norms, GDN). "outside the model" is vLLM's step loop
(scheduling, input preparation, sampling), which both arms share.

    python benchmarks/engine_profile.py [--family dense|moe|gdn] [--size small|medium]

Each arm's process group is killed on exit, failure or interrupt (no engine outlives this).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from isoexec.tools.bench import PROMPT_LEN, SIZES, kv_cache_bytes, make_model

ARMS = ("isoexec", "native")


def _install_timers(model: torch.nn.Module) -> None:
    """Forward pre/post hooks on every module: exclusive seconds per class, in `model`."""
    spent: dict[str, float] = defaultdict(float)
    stack: list[list[float]] = []  # [start, children's inclusive time]

    def pre(_m: torch.nn.Module, _args: Any) -> None:
        stack.append([time.perf_counter(), 0.0])

    def post(m: torch.nn.Module, _args: Any, _out: Any) -> None:
        start, children = stack.pop()
        inclusive = time.perf_counter() - start
        spent[type(m).__name__] += inclusive - children
        if stack:
            stack[-1][1] += inclusive

    for mod in model.modules():
        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)
    model._isoexec_bench_spent = spent  # type: ignore[assignment]


def _read_timers(model: torch.nn.Module) -> dict[str, float]:
    spent = dict(model._isoexec_bench_spent)  # type: ignore[arg-type]
    model._isoexec_bench_spent.clear()  # type: ignore[union-attr]
    return spent


def run_arm(
    arm: str, model: str, dtype: str, prompts: int, tokens: int, out: str, eager: bool = False
) -> None:
    """One engine (this process), one warm-up and one timed generation; JSON to `out`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from isoexec.vllm.engine_process import EngineConfig, SamplingSpec, _Handler

    kv = kv_cache_bytes(prompts, tokens)
    handler = _Handler(
        EngineConfig(
            model=model,
            dtype=dtype,
            isoexec=arm == "isoexec",
            kv_cache_bytes=kv,
            enforce_eager=eager,
        )
    )
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(1000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(prompts)]
    # Warm-up at the timed batch's shapes (its prefill and its decode row count): the first
    # call at a new shape pays one-time costs (IsoExec's per-shape GEMM checks, packing) that
    # a timed step must not count.
    handler.generate(batch, SamplingSpec(max_tokens=min(tokens, 8)))
    handler.llm.apply_model(_install_timers)
    handler.llm.apply_model(_read_timers)
    handler.llm.reset_prefix_cache()
    t = time.perf_counter()
    handler.generate(batch, SamplingSpec(max_tokens=tokens, temperature=1.0))
    total = time.perf_counter() - t
    spent = handler.llm.apply_model(_read_timers)[0]
    Path(out).write_text(json.dumps({"total_s": total, "modules_s": spent}))


def _spawn_arm(arm: str, args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--arm", arm, "--model", str(model), "--out", str(out)]
    cmd += ["--dtype", args.dtype, "--prompts", str(args.prompts), "--tokens", str(args.tokens)]
    cmd += ["--eager"] if args.eager else []
    env = {**os.environ, "ISOEXEC": "1" if arm == "isoexec" else "0"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        if proc.wait(timeout=3600) != 0:
            raise RuntimeError(f"{arm} arm failed (exit {proc.returncode})")
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["dense", "moe", "gdn"], default="dense")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument(
        "--eager",
        action="store_true",
        help="both arms eager: per-module rows (compiled, the model forward is one graph)",
    )
    ap.add_argument("--arm", choices=["isoexec", "native"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="engine-profile.json", help="where the JSON report goes")
    args = ap.parse_args()
    if args.arm:
        run_arm(args.arm, args.model, args.dtype, args.prompts, args.tokens, args.out, args.eager)
        return
    args.dtype = args.dtype or ("bfloat16" if args.family == "gdn" else "float32")
    size = SIZES[args.size]
    args.prompts, args.tokens = size["prompts"], size["tokens"]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(
            Path(tmp) / "model",
            size["hidden"],
            size["layers"],
            size["vocab"],
            args.family,
            args.dtype,
        )
        arms = {a: _spawn_arm(a, args, model, Path(tmp) / f"{a}.json") for a in ARMS}
    Path(args.out).write_text(json.dumps({"settings": {**vars(args), **size}, "arms": arms}))
    iso, nat = arms["isoexec"], arms["native"]
    print(f"{args.family} {args.size} {args.dtype}: {args.prompts} prompts x {args.tokens} tokens")
    print(f"{'':<34}{'isoexec s':>10}{'native s':>10}")
    rows: dict[str, tuple[float, float]] = {}
    for name in set(iso["modules_s"]) | set(nat["modules_s"]):
        rows[name] = (iso["modules_s"].get(name, 0.0), nat["modules_s"].get(name, 0.0))
    for arm in (iso, nat):
        arm["model_s"] = sum(arm["modules_s"].values())
    for name, (a, b) in sorted(rows.items(), key=lambda kv: -max(kv[1])):
        if max(a, b) >= 0.01 * iso["total_s"]:
            print(f"  {name:<32}{a:>10.3f}{b:>10.3f}")
    print(f"  {'model forward':<32}{iso['model_s']:>10.3f}{nat['model_s']:>10.3f}")
    out_i, out_n = iso["total_s"] - iso["model_s"], nat["total_s"] - nat["model_s"]
    print(f"  {'outside the model':<32}{out_i:>10.3f}{out_n:>10.3f}")
    print(f"  {'generate total':<32}{iso['total_s']:>10.3f}{nat['total_s']:>10.3f}")


if __name__ == "__main__":
    main()
