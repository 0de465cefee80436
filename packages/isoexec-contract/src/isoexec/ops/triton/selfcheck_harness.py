"""The harness pieces of the Triton self-checks (`selfcheck`): a row computed alone against
the same row inside batches, and a TP group's ranks run in one process with an exact in-order
gather."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def row_mismatches(
    fn: Callable[..., torch.Tensor],
    gen: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]],
    sizes: Sequence[int],
    seed: int = 0,
) -> list[tuple[int, int]]:
    """[(M, position)] where row 0 of `gen(1)` computed inside a batch of M random rows (at
    the middle and at the end) differs from the same row computed alone."""
    g = torch.Generator().manual_seed(seed)
    row = gen(1, g)
    alone = fn(*row)[0]
    bad = []
    for m in sizes:
        for pos in sorted({m // 2, m - 1}):
            batch = gen(m, g)
            for b, r in zip(batch, row, strict=True):
                b[pos] = r[0]
            if not torch.equal(fn(*batch)[pos], alone):
                bad.append((m, pos))
    return bad


def in_order_gather(
    parts_by_rank: Sequence[torch.Tensor], rank: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A TP group's exact all-gather along dim 0 in rank order, as seen from `rank` in one
    process: the rank's own tensor (the one it passes) at its slot, the others' given."""

    def all_gather(own: torch.Tensor) -> torch.Tensor:
        return torch.cat([own if r == rank else p for r, p in enumerate(parts_by_rank)])

    return all_gather


def linear_tp_shard_ranks(
    shard_fn: Callable[..., torch.Tensor],
    leaf_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    tp: int,
    leaves: int,
) -> list[torch.Tensor]:
    """Every rank's output of `shard_fn` (a `linear_tp_shard`) at `tp`, the K-shards of x and
    w split in rank order and the leaves gathered by `in_order_gather` (`leaf_fn`: the other
    ranks' `tp_leaf_partials`)."""
    xs, ws = x.chunk(tp, -1), w.chunk(tp, -1)
    parts = [leaf_fn(a, b, leaves=leaves // tp) for a, b in zip(xs, ws, strict=True)]
    return [
        shard_fn(xs[r], ws[r], bias, tp=tp, all_gather=in_order_gather(parts, r), leaves=leaves)
        for r in range(tp)
    ]
