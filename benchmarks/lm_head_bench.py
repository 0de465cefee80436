"""Time the lm head + token logprobs at real Qwen vocabularies, canonical against native
(not a test; #37 item 3).

Canonical: `ops.linear` (32-row blocks, oneDNN's prepacked weight where it applies) and
`ops.token_logprobs`. Native: `F.linear`, then `log_softmax(float) + gather`, what a stock
trainer or engine does. Both arms alternate within one run; medians are compared.
Usage: python benchmarks/lm_head_bench.py [--reps N] [--rows 1,8,256] [--dtypes fp32,bf16]
       [--no-cache]   (the trainer's condition: the packed weight is not kept across calls)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from ops_bench import median_pair  # this directory: alternated medians, one rule

from isoexec import ops

# (name, hidden, vocab): Qwen3-0.6B's head and Qwen3.5-35B-A3B's.
HEADS = (("qwen3-0.6b", 1024, 151936), ("qwen3.5-35b-a3b", 2048, 248320))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rows", default="1,8,256", help="tokens per call (comma-separated)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--no-cache", action="store_true", help="pack the weight on every call")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    ops.gemm.enable_packed_weight_cache(not args.no_cache)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"packed-weight cache {'off' if args.no_cache else 'on'}")  # fmt: skip
    print(f"{'head':<18}{'dtype':<6}{'rows':>6}{'canonical ms':>14}{'native ms':>11}{'ratio':>8}")
    with torch.no_grad():
        for name, hidden, vocab in HEADS:
            for dn in args.dtypes.split(","):
                dtype = DTYPES[dn]
                # A parameter, with the packed-weight cache on: as in an engine (a trainer
                # packs per call, its cache off: `--no-cache`).
                w = torch.nn.Parameter(
                    (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(dtype),
                    requires_grad=False,
                )
                for m in rows:
                    x = torch.randn(m, hidden, generator=g).to(dtype)
                    ids = torch.randint(0, vocab, (m,), generator=g)

                    def canonical(
                        x: torch.Tensor = x, ids: torch.Tensor = ids, w: torch.Tensor = w
                    ) -> object:
                        return ops.token_logprobs(ops.linear(x, w), ids)

                    def native(
                        x: torch.Tensor = x, ids: torch.Tensor = ids, w: torch.Tensor = w
                    ) -> object:
                        logits = F.linear(x, w)
                        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])

                    c, n = median_pair(canonical, native, args.reps)
                    print(f"{name:<18}{dn:<6}{m:>6}{c * 1e3:>14.2f}{n * 1e3:>11.2f}{c / n:>8.2f}",
                          flush=True)  # fmt: skip
                ops.gemm.clear_packed_weight_cache()


if __name__ == "__main__":
    main()
