"""Data-parallel gradients in a fixed order: the same bits at every DP degree.

Why: a DP all-reduce sums each rank's accumulated gradient, so the order in which the global
batch's micro-batch gradients are added depends on how many ranks share it (DP=1 adds them one
after another, DP=2 adds two halves). Here the global batch is cut into units that do not
depend on DP (the packs of `train_step`), padded with empty units to a power of two, and the
unit gradients are summed in one fixed binary tree of adjacent pairs, as `ops.tp_tree_sum`
sums TP leaves. Each rank owns a contiguous power-of-two block of units, so its local sums are
whole subtrees; the ranks' subtree sums are all-gathered in rank order and the tree is
finished on every rank. DP=1, 2, 4, ... give the same gradient bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from isoexec import ops


def padded_units(num_units: int, dp: int) -> int:
    """Units after padding: a power of two, at least `dp` (DP=1 and DP>1 pad to the same)."""
    if dp < 1 or dp & (dp - 1):
        raise ValueError(f"data-parallel size {dp} must be a power of two")
    n = max(num_units, dp, 1)
    return 1 << (n - 1).bit_length()


def rank_units(num_units: int, dp: int, rank: int) -> range:
    """The contiguous block of (padded) unit indices DP rank `rank` computes."""
    per = padded_units(num_units, dp) // dp
    return range(rank * per, (rank + 1) * per)


class GradTree:
    """Adds unit gradients as a fixed tree of adjacent pairs, keeping O(log n) partial sums.

    `push` the units of one contiguous power-of-two block in order (an empty unit as None: it
    counts as zeros); `result()` is their subtree sum, the same bits `ops.tp_tree_sum` gives.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._stack: list[tuple[int, list[torch.Tensor]]] = []  # (level, grads)

    def push(self, grads: Sequence[torch.Tensor | None] | None) -> None:
        if grads is None:
            grads = [None] * len(self.params)
        node = [
            torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads, strict=True)
        ]
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            node = [a + b for a, b in zip(left, node, strict=True)]
            level += 1
        self._stack.append((level, node))

    def result(self) -> list[torch.Tensor]:
        if len(self._stack) != 1:
            raise ValueError(f"not one whole subtree: {len(self._stack)} partial sums (push 2^k)")
        return self._stack[0][1]


def finish_over_dp(
    partial: list[torch.Tensor], group: torch.distributed.ProcessGroup | None, dp: int
) -> list[torch.Tensor]:
    """All-gather every rank's subtree sum in rank order, then finish the tree (DP=1: as is)."""
    if dp == 1:
        return partial
    out = []
    for g in partial:
        parts = [torch.empty_like(g) for _ in range(dp)]
        torch.distributed.all_gather(parts, g.contiguous(), group=group)
        out.append(ops.tp_tree_sum(torch.stack(parts)))
    return out


__all__ = ["GradTree", "finish_over_dp", "padded_units", "rank_units"]
