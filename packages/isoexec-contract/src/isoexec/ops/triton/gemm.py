"""Triton linear: fixed output tiles, one program per tile, K walked in one fixed order.

Why: a row's bits must not depend on M. Every program computes one BLOCK_M x BLOCK_N tile
and walks K in BLOCK_K steps from 0 upwards into one fp32 accumulator (no split-K, no
atomics), so a row's result depends only on its own inputs and the fixed tile constants;
M only changes how many programs run. M is never a specialisation key
(`do_not_specialize`), so M=1 compiles to the same code as M=4096. Loads are upcast to
fp32 (bf16 mantissas fit TF32, so the MMA multiplies them exactly); one rounding at the end.

The TP-invariant variant runs the same kernel per fixed K-leaf (fp32 out) and sums the
leaves with the torch canonical fixed binary tree (elementwise IEEE adds: same bits on
every backend).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .. import gemm as _torch_gemm
from ._runtime import check_device, dot_precision, store_rounded, with_torch_backward

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
DEFAULT_TP_LEAVES = _torch_gemm.DEFAULT_TP_LEAVES


@triton.jit
def tile_dot(
    x_ptr,
    w_ptr,
    rows,
    rn,
    m_ok,
    n_ok,
    K,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The fp32 [BLOCK_M, BLOCK_N] tile of x[rows] @ w[rn].T: the one K walk every IsoExec
    GEMM takes (BLOCK_K steps in order, fp32 operands, one dot per step), so the dense linear
    and the grouped MoE experts give a row the same bits whichever rows share its tile."""
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + kk[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        b = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # int64 indices: `rm * stride_ym` passes 2**31 beyond 14,134 rows of a 151,936-wide lm head
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tile_dot(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn,
                   BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)  # fmt: skip
    store_rounded(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, m_ok[:, None] & n_ok[None, :])


def gemm(
    x2: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """`x2 @ weight.T` for x2 [M, K], weight [N, K] (no autograd); out in x2's dtype or
    `out_dtype` (fp32 for un-rounded partials)."""
    check_device(x2)
    x2 = x2.contiguous()
    weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _linear_kernel[grid](
        x2,
        weight,
        y,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x2.dtype),
    )
    return y


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """Row-invariant `x @ weight.T (+ bias)` for x [..., K], weight [N, K].

    Same contract as the torch canonical `linear`: bias added after the single rounding, in
    x's dtype. Backward: the torch canonical op's (correct, not bitwise).
    """
    if weight.dtype != x.dtype:
        raise TypeError(f"linear: x {x.dtype} and weight {weight.dtype} differ")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])

    def run(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return gemm(a, w, block_m=block_m, block_n=block_n, block_k=block_k)

    y = with_torch_backward(run, _torch_gemm.linear, x2, weight)
    y = y.reshape(*lead, weight.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def tp_leaf_partials(
    x_shard: torch.Tensor, weight_shard: torch.Tensor, *, leaves: int
) -> torch.Tensor:
    """fp32 partial products [leaves, M, N] of `leaves` equal K-leaves of one K-shard.

    Backward: the torch canonical `tp_leaf_partials`' (correct, not bitwise), so the TP forms
    built on it (`linear_tp_shard`, `tp_linear_from_shards`, `linear_tp_invariant`) train.
    """
    k = x_shard.shape[-1]
    if k % leaves:
        raise ValueError(f"K-shard {k} not divisible by {leaves} leaves")
    kl = k // leaves

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, k).float()
        wf = w.float()
        return torch.stack(
            [
                gemm(
                    x2[:, i * kl : (i + 1) * kl],
                    wf[:, i * kl : (i + 1) * kl],
                    out_dtype=torch.float32,
                )
                for i in range(leaves)
            ]
        )

    def ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _torch_gemm.tp_leaf_partials(x, w, leaves=leaves)

    return with_torch_backward(run, ref, x_shard, weight_shard)  # type: ignore[return-value]


def tp_linear_from_shards(
    x_shards: list[torch.Tensor],
    weight_shards: list[torch.Tensor],
    bias: torch.Tensor | None = None,
    *,
    leaves: int = DEFAULT_TP_LEAVES,
) -> torch.Tensor:
    """Row-parallel linear from TP K-shards (rank order): gather leaves, tree-sum, round.

    Differentiable: the leaves' backward is the torch canonical op's, the concatenation,
    tree sum and rounding are torch ops under autograd."""
    tp = len(x_shards)
    if leaves % tp:
        raise ValueError(f"leaves={leaves} not divisible by TP={tp}")
    parts = torch.cat(
        [
            tp_leaf_partials(xs, ws, leaves=leaves // tp)
            for xs, ws in zip(x_shards, weight_shards, strict=True)
        ]
    )
    return _torch_gemm._tree_sum_round(parts, bias, x_shards[0], weight_shards[0].shape[0])


def linear_tp_shard(
    x_shard: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tp: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    leaves: int = DEFAULT_TP_LEAVES,
) -> torch.Tensor:
    """One TP rank's share of `linear_tp` in a live TP group: the torch `linear_tp_shard`
    with this rank's leaves computed by the Triton kernel (the tiles are this module's, so
    there is no `block_rows`).

    The rank's [G/tp, M, N] fp32 leaf partials, the framework's exact `all_gather` along dim 0
    in rank order, then the torch fixed tree and one rounding (elementwise IEEE adds: the same
    bits on any device). Equals `linear_tp_invariant` on the whole K, bit for bit, at every
    TP dividing G. Differentiable when `all_gather` is (Megatron's gather region is); a gather
    that drops the leaves' graph under autograd is refused, never a silent loss of gradients.
    """
    if tp < 1 or leaves % tp:
        raise ValueError(f"leaves={leaves} not divisible by TP={tp}")
    own = tp_leaf_partials(x_shard, weight_shard, leaves=leaves // tp)
    parts = own
    if tp > 1:
        if all_gather is None:
            raise ValueError(f"linear_tp_shard at TP={tp} needs the group's all_gather")
        parts = all_gather(own)
        if parts.shape[0] != leaves:
            raise ValueError(f"all_gather returned {parts.shape[0]} leaves, expected {leaves}")
        if own.requires_grad and not parts.requires_grad:
            raise RuntimeError(
                "linear_tp_shard: all_gather dropped the leaves' autograd graph (x/weight would "
                "get no gradient); use a differentiable gather (Megatron's gather region) or "
                "run without autograd"
            )
    return _torch_gemm._tree_sum_round(parts, bias, x_shard, weight_shard.shape[0])


def linear_tp_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    leaves: int = DEFAULT_TP_LEAVES,
) -> torch.Tensor:
    """TP-invariant linear: equals `tp_linear_from_shards` for any TP dividing `leaves`."""
    return tp_linear_from_shards([x], [weight], bias, leaves=leaves)
