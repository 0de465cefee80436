"""Canonical LoRA: the adapter's contribution to a linear's output, the same on both sides.

Why: an adapter adds `scaling * (x @ A.T) @ B.T` to a linear's output, and each engine and
trainer computes it its own way (vLLM's punica kernels shrink in fp32 and scale there; a
trainer's adapter layer runs two `F.linear`s and scales the product). Those differ in bits,
and in a co-batched engine they can depend on which adapters share the batch.

The canonical form, per output slice (q, k, v of a fused QKV; gate, up of a fused MLP):
- the scaling is folded into B once, in B's dtype (`fold_scaling`), as vLLM loads adapters;
- A and B are zero-padded to a fixed rank R (the engine's `max_lora_rank`, recorded in the
  contract), so both GEMMs have the same shapes on both sides whatever each adapter's rank;
- shrink `h = linear(x, A)` and expand `d = linear(h, B)` are the canonical row-block linear
  (each rounded once to the activation dtype);
- the slice's output is `base + d`, one elementwise add; a slice whose B is all zero (a module
  the adapter does not target, or PEFT's zero-initialised B) adds nothing.
Each row's bits depend only on that row and its own adapter: the linear is row-invariant, so
rows grouped by adapter on the engine get the bits of the trainer's whole-batch call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .gemm import DEFAULT_BLOCK_ROWS, linear


def fold_scaling(b: torch.Tensor, scaling: float) -> torch.Tensor:
    """B with the adapter's scaling (alpha / r, or rsLoRA's) folded in, in B's dtype."""
    return b if scaling == 1 else b * scaling


def pad_rank(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, K] and B [N, r] zero-padded to `rank` (A's rows, B's columns)."""
    r = a.shape[0]
    if b.shape[-1] != r:
        raise ValueError(f"LoRA A has rank {r} but B has {b.shape[-1]}")
    if r > rank:
        raise ValueError(f"LoRA rank {r} exceeds the padded rank {rank} (max_lora_rank)")
    if r == rank:
        return a, b
    return F.pad(a, (0, 0, 0, rank - r)), F.pad(b, (0, rank - r))


def lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, block_rows: int = DEFAULT_BLOCK_ROWS
) -> torch.Tensor:
    """`(x @ a.T) @ b.T` as two canonical linears; a [R, K], b [N, R] at the padded rank,
    the scaling already in b. Differentiable (the linear's backward) for a trained adapter."""
    return linear(linear(x, a, block_rows=block_rows), b, block_rows=block_rows)


def lora_apply(
    base: torch.Tensor,
    x: torch.Tensor,
    slices: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
    widths: Sequence[int],
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """`base` [..., sum(widths)] (slices side by side, vLLM's layout) with each slice's delta
    added; `slices[i]` is (A, B) at the padded rank with the scaling folded in, or None.

    Returns a new tensor (autograd flows to A and B); `base` is left as it is.
    """
    if len(slices) != len(widths) or sum(widths) != base.shape[-1]:
        raise ValueError(f"LoRA slices {list(widths)} do not tile the output {base.shape[-1]}")
    pieces = list(base.split(list(widths), dim=-1))
    touched = False
    for i, ab in enumerate(slices):
        if ab is None or not bool(ab[1].any()):
            continue
        a, b = ab
        if b.shape[0] != widths[i]:
            raise ValueError(f"LoRA B of slice {i} has {b.shape[0]} rows, the slice {widths[i]}")
        pieces[i] = pieces[i] + lora_delta(x, a, b, block_rows=block_rows)
        touched = True
    if not touched:
        return base
    return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]


def lora_apply_by_slot(
    base: torch.Tensor,
    x: torch.Tensor,
    slot_of_row: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    b_stacked: Sequence[torch.Tensor],
    widths: Sequence[int],
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """`lora_apply` for a batch whose rows use different adapters (an engine's co-batch).

    `slot_of_row` [M]: each row's adapter slot, -1 for none; `a_stacked[i]` [slots, 1, R, K]
    and `b_stacked[i]` [slots, 1, N_i, R] per slice, padded to R with the scaling folded in
    (vLLM's stacked LoRA buffers). The rows of each slot run `lora_apply` together; a row's
    bits depend only on itself and its own adapter (the linear is row-invariant).
    """
    out = base
    for slot in sorted({int(s) for s in slot_of_row.tolist()} - {-1}):
        rows = (slot_of_row == slot).nonzero().flatten()
        slices = [(a[slot, 0], b[slot, 0]) for a, b in zip(a_stacked, b_stacked, strict=True)]
        mixed = lora_apply(
            base.index_select(0, rows), x.index_select(0, rows), slices, widths,
            block_rows=block_rows,
        )  # fmt: skip
        if out is base:
            out = base.clone()
        out.index_copy_(0, rows, mixed)
    return out


def lora_expand_by_slot(
    base: torch.Tensor,
    h: torch.Tensor,
    slot_of_row: torch.Tensor,
    b_stacked: torch.Tensor,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """An embedding's adapter: `h` [M, R] is each row's A row (a lookup, exact), so only the
    expand runs: `base + linear(h, B)` per slot, a zero B adding nothing (`lora_apply`'s rule).
    `b_stacked` [slots, 1, N, R]."""
    out = base
    for slot in sorted({int(s) for s in slot_of_row.tolist()} - {-1}):
        b = b_stacked[slot, 0]
        if not bool(b.any()):
            continue
        rows = (slot_of_row == slot).nonzero().flatten()
        delta = linear(h.index_select(0, rows), b, block_rows=block_rows)
        if out is base:
            out = base.clone()
        out.index_copy_(0, rows, base.index_select(0, rows) + delta)
    return out


__all__ = [
    "fold_scaling",
    "lora_apply",
    "lora_apply_by_slot",
    "lora_delta",
    "lora_expand_by_slot",
    "pad_rank",
]
