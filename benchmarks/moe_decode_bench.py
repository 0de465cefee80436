"""One decode step of the GDN bench model's routed MoE, IsoExec vs vLLM's CPU MoE (not a test).

The medium `isoexec bench --family gdn` model: hidden 768, 8 experts of width 384, top-2,
8 layers (each its own weights, so the step streams them from memory as the engine does),
32 tokens, one thread. IsoExec: `ops.moe_experts` (bf16: the AMX tile kernel where the CPU
has AMX-BF16, else the canonical linear's oneDNN blocks per expert; packed weights cached as
in the engine; the kernel is printed). Native: vLLM's `cpu_fused_moe`
(AMX where the CPU has it, else its vector kernel) on its own prepacked weights. Arms
alternate; medians. Prints ms per step, the ratio, and each arm's weight-streaming rate.

    python benchmarks/moe_decode_bench.py [--tokens 32] [--dtype bfloat16] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from isoexec.ops import gemm, moe

HIDDEN, WIDTH, EXPERTS, TOP_K, LAYERS = 768, 384, 8, 2, 8


def _time(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    dtype = getattr(torch, args.dtype)
    # vLLM's AMX MoE kernel takes bf16 only
    amx = dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
    isa = "amx" if amx else "vec"
    if amx:  # Linux hands out AMX state on request: vLLM's worker asks at start-up, and
        # oneDNN on its first AMX GEMM; outside an engine, such a GEMM asks for it here.
        torch.mm(torch.ones(32, 64, dtype=dtype), torch.ones(64, 64, dtype=dtype))
    gemm.enable_packed_weight_cache(True)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        w13 = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen).to(dtype) * 0.03
        w2 = torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen).to(dtype) * 0.03
        p13, p2 = torch.empty_like(w13), torch.empty_like(w2)
        torch.ops._C.prepack_moe_weight(w13, p13, isa)
        torch.ops._C.prepack_moe_weight(w2, p2, isa)
        as_param = [torch.nn.Parameter(w, requires_grad=False) for w in (w13, w2)]
        layers.append((*as_param, p13, p2))
    x = torch.randn(args.tokens, HIDDEN, generator=gen).to(dtype)
    weights, ids = moe.moe_router(torch.randn(args.tokens, EXPERTS, generator=gen), TOP_K,
                                  renormalize=True)  # fmt: skip
    ids32 = ids.to(torch.int32)
    out = torch.empty_like(x)

    def iso() -> None:
        for w13, w2, _, _ in layers:
            moe.moe_experts(x, ids, w13, w2)

    def native() -> None:
        for _, _, p13, p2 in layers:
            torch.ops._C.cpu_fused_moe(out, x, p13, p2, None, None, weights, ids32, False,
                                       "silu", isa)  # fmt: skip

    with torch.inference_mode():
        iso(), native()
        ti, tn = [], []
        for _ in range(args.reps):
            ti.append(_time(iso))
            tn.append(_time(native))
    mi, mn = statistics.median(ti), statistics.median(tn)
    mb = LAYERS * EXPERTS * 3 * WIDTH * HIDDEN * x.element_size() / 1e6
    print(f"MoE decode step: {args.tokens} tokens, {LAYERS} layers x {EXPERTS} experts "
          f"({mb:.0f} MB of weights), {args.dtype}, 1 thread, native isa {isa}")  # fmt: skip
    print(f"  isoexec {mi * 1e3:7.2f} ms  ({mb / 1e3 / mi:5.1f} GB/s)  {moe.expert_gemm(dtype)}")
    print(f"  native  {mn * 1e3:7.2f} ms  ({mb / 1e3 / mn:5.1f} GB/s)")
    print(f"  ratio   {mi / mn:.2f}x")


if __name__ == "__main__":
    main()
