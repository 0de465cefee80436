"""Triton expert GEMMs over all experts in one launch, with the routing kept on the device.

Why: vLLM captures the MoE block inside a CUDA graph. A per-expert loop needs the routed
experts on the host (`unique().tolist()`), a sync that capture refuses and that a replay
would skip. Here the routing becomes a padded layout computed with fixed-size device ops
(argsort, scatter, cumsum, searchsorted: no sync, no data-dependent shape), and one launch
with a fixed grid walks it: each BLOCK_M-row block belongs to one expert (or to none, and
exits), its rows are gathered (token, slot) pairs of that expert.

Bits: a program computes its tile with `gemm.tile_dot`, the K walk `gemm._linear_kernel`
runs (the same BLOCK_M, BLOCK_N, BLOCK_K, one fp32 accumulator, the same dot precision, one
rounding), only with gathered row addresses. A row's result depends on its own inputs and
the tile constants, never on its position in the tile (the linear's row-invariance), so each
(token, slot) row has the bits of the per-expert `linear` the trainer's loop computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import check_device, dot_precision, store_rounded
from .gemm import BLOCK_K, BLOCK_M, BLOCK_N, tile_dot


@triton.jit
def _grouped_linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    a_rows_ptr,
    y_rows_ptr,
    block_expert_ptr,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= 0:  # a block past the used ones: nothing to do (the grid is sized for the worst case)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        a_row = tl.load(a_rows_ptr + r).to(tl.int64)  # -1: a padding row
        y_row = tl.load(y_rows_ptr + r).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = a_row >= 0
        n_ok = rn < N
        acc = tile_dot(x_ptr, w_ptr + e * stride_we, a_row, rn, m_ok, n_ok, K, stride_xm,
                       stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)  # fmt: skip
        y_ok = (y_row >= 0)[:, None] & n_ok[None, :]
        store_rounded(y_ptr + y_row[:, None] * stride_ym + rn[None, :], acc, y_ok)


def expert_layout(
    topk_ids: torch.Tensor, first_expert: int, n_local: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [n_blocks * block_m], block_expert [n_blocks]) for the routed (token, slot) pairs.

    `rows[p]` is the flat (token * k + slot) index placed at padded position p, or -1 for
    padding; each expert's pairs are contiguous, in ascending flat index, from a multiple of
    `block_m`. `block_expert[b]` is the local expert of block b, or -1 for an unused block.
    Pairs routed outside `first_expert .. first_expert + n_local` are left out. Every shape
    depends only on (T, k, n_local, block_m), and nothing is read back to the host.
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    local = flat - first_expert
    key = torch.where((local >= 0) & (local < n_local), local, n_local)  # n_local: not here
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    start = torch.cumsum(counts, 0) - counts
    padded = (counts[:n_local] + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    n_blocks = triton.cdiv(n + n_local * (block_m - 1), block_m)
    cap = n_blocks * block_m
    skey = key[order]
    rank = torch.arange(n, device=dev) - start[skey]
    here = skey < n_local
    pos = (pend - padded)[skey.clamp(max=n_local - 1)] + rank
    pos = torch.where(here, pos, cap + torch.arange(n, device=dev))  # one spill slot each
    rows = torch.full((cap + n,), -1, dtype=torch.int64, device=dev).scatter_(0, pos, order)
    first_row = torch.arange(n_blocks, device=dev, dtype=torch.int64) * block_m
    e = torch.searchsorted(pend, first_row, right=True)
    block_expert = torch.where(e < n_local, e, -1)
    return rows[:cap].contiguous(), block_expert.contiguous()


def grouped_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    a_rows: torch.Tensor,
    y_rows: torch.Tensor,
    block_expert: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[y_rows[p]] = x[a_rows[p]] @ w[block_expert[p // BLOCK_M]].T for every p whose
    rows are >= 0 (w [E, N, K]); rows of `out` no p names are left as they are."""
    check_device(x)
    x = x.contiguous()
    w = w.contiguous()
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    if block_expert.numel():
        _grouped_linear_kernel[grid](
            x,
            w,
            out,
            a_rows,
            y_rows,
            block_expert,
            n,
            k,
            x.stride(0),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            PRECISION=dot_precision(x.dtype),
        )
    return out


def grouped_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    silu_mul: object,
    *,
    first_expert: int = 0,
) -> torch.Tensor:
    """Expert outputs [T, k, H] (slots of other ranks' experts -0.0): fc1 gathered by token
    into the padded layout, `silu_mul` there (row-wise), fc2 scattered back to (token, slot)."""
    t, k = topk_ids.shape
    h = w2.shape[1]
    rows, block_expert = expert_layout(topk_ids, first_expert, w13.shape[0])
    tok = torch.where(rows >= 0, rows // k, -1)
    positions = torch.arange(rows.numel(), device=rows.device)
    up = x.new_zeros((rows.numel(), w13.shape[1]))
    grouped_linear(x, w13, tok, positions, block_expert, up)
    act = silu_mul(up)  # type: ignore[operator]
    out = x.new_full((t * k, h), -0.0)
    grouped_linear(act, w2, positions, rows, block_expert, out)
    return out.view(t, k, h)


__all__ = ["expert_layout", "grouped_experts", "grouped_linear"]
