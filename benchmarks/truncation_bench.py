"""Time the canonical truncation (`isoexec.ops.truncation.truncation_mask`) against vLLM's
PyTorch top-k/top-p (`apply_top_k_top_p_pytorch`, what vLLM-CPU runs without Triton), at the
vocabularies users run (32k, Qwen3's 151,936, Qwen3.5's 248,320) and a decode batch of 8.

Not a test. The two alternate within one run and the median of each is taken, so background
load hits both alike. Settings: Qwen3's shipped top_k 20 / top_p 0.95 (the fast path: only a
prefix is sorted), and top-p alone (the whole row is sorted).
Usage: python benchmarks/truncation_bench.py [--reps N] [--batch B]
"""

from __future__ import annotations

import argparse

import torch
from ops_bench import median_pair  # (this directory: run as a script)

from isoexec.ops.truncation import Truncation, truncation_mask

VOCABS = (32768, 151936, 248320)
SETTINGS = {
    "top_k 20 + top_p 0.95": Truncation(top_k=20, top_p=0.95),
    "top_p 0.95": Truncation(top_p=0.95),
}


def main() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    b = args.batch
    print(f"torch threads {torch.get_num_threads()}, batch {b}")
    print(f"{'setting':<24} {'vocab':>7} {'isoexec ms':>11} {'vLLM ms':>9} {'ratio':>6}")
    for name, cut in SETTINGS.items():
        for v in VOCABS:
            x = torch.randn(b, v, generator=torch.Generator().manual_seed(v)) * 3
            temps = torch.full((b,), 0.6)
            rows = cut.rows(b, "cpu")
            k = None if cut.top_k <= 0 else torch.full((b,), cut.top_k, dtype=torch.int32)
            p = torch.full((b,), cut.top_p)
            ours, theirs = median_pair(
                lambda: truncation_mask(x, temps, rows),  # noqa: B023
                lambda: apply_top_k_top_p_pytorch(x / 0.6, k, p, allow_cpu_sync=True),  # noqa: B023
                args.reps,
            )
            print(
                f"{name:<24} {v:>7} {ours * 1e3:>11.1f} {theirs * 1e3:>9.1f} {ours / theirs:>6.2f}"
            )


if __name__ == "__main__":
    main()
