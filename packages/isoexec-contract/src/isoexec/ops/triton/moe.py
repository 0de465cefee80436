"""Triton MoE: router (fp32 softmax, top-k with ties to the lower expert index) and the
fixed-order combine (ascending expert id, fp32, shared expert last, one rounding).

Why: one program per token sees only that token's logits / expert outputs. The router's
top-k is k passes of (max, then the lowest index holding it), so equal probabilities go to
the lower index whatever the vector width. The combine visits a token's k experts in
ascending id (`order` from a stable integer argsort) into one fp32 accumulator. Expert
GEMMs are the row-invariant Triton `linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import moe as _torch_moe
from ._runtime import check_device, pow2, store_rounded, with_torch_backward
from .elementwise import silu_mul
from .gemm import linear
from .moe_grouped import grouped_experts

COMBINE_BLOCK = 1024


@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    E,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(x_ptr + row * E + e, mask=ok, other=float("-inf")).to(tl.float32)
    ex = tl.exp(x - tl.max(x, axis=0))
    p = tl.math.div_rn(ex, tl.sum(ex, axis=0))
    p = tl.where(ok, p, -1.0)  # padding lanes are never picked (probabilities are >= 0)
    kk = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_K,), tl.float32)
    ids = tl.zeros((BLOCK_K,), tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        w = tl.where(kk == j, best, w)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        w = tl.math.div_rn(w, tl.sum(w, axis=0))
    kok = kk < TOP_K
    tl.store(w_ptr + row * TOP_K + kk, w, mask=kok)
    tl.store(ids_ptr + row * TOP_K + kk, ids, mask=kok)


def moe_router(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k]); same contract as the torch op."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_device(x)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        t, e = x2.shape
        w = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
        if t:
            _router_kernel[(t,)](
                x2,
                w,
                ids,
                e,
                TOP_K=top_k,
                BLOCK_E=pow2(e),
                BLOCK_K=pow2(top_k),
                RENORM=renormalize,
            )
        return w, ids

    def ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _torch_moe.moe_router(x, top_k, renormalize=renormalize)

    return with_torch_backward(run, ref, router_logits)  # type: ignore[return-value]


@triton.jit
def _combine_kernel(
    y_ptr,
    w_ptr,
    order_ptr,
    sh_ptr,
    g_ptr,
    out_ptr,
    H,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = col < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(order_ptr + t * TOP_K + j).to(tl.int64)
        wj = tl.load(w_ptr + t * TOP_K + slot).to(tl.float32)
        yj = tl.load(y_ptr + (t * TOP_K + slot) * H + col, mask=ok, other=0.0).to(tl.float32)
        if j == 0:
            acc = wj * yj
        else:
            acc = acc + wj * yj
    if HAS_SHARED:
        sh = tl.load(sh_ptr + t * H + col, mask=ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(g_ptr + t).to(tl.float32)
            sh = tl.math.div_rn(1.0, 1.0 + tl.exp(-g)) * sh
        acc = acc + sh
    store_rounded(out_ptr + t * H + col, acc, ok)


def moe_weighted_sum(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block: int = COMBINE_BLOCK,
) -> torch.Tensor:
    """Fixed-order combine (same contract as the torch canonical `moe_weighted_sum`)."""

    def run(
        y: torch.Tensor, w: torch.Tensor, sh: torch.Tensor | None, g: torch.Tensor | None
    ) -> torch.Tensor:
        check_device(y)
        t, k, h = y.shape
        order = torch.argsort(topk_ids, dim=-1, stable=True).contiguous()
        out = torch.empty(t, h, dtype=out_dtype or y.dtype, device=y.device)
        if t:
            _combine_kernel[(t, triton.cdiv(h, block))](
                y.contiguous(),
                w.float().contiguous(),
                order,
                sh.contiguous() if sh is not None else y,
                g.reshape(-1).contiguous() if g is not None else y,
                out,
                h,
                TOP_K=k,
                BLOCK=block,
                HAS_SHARED=sh is not None,
                HAS_GATE=g is not None,
            )
        return out

    def ref(
        y: torch.Tensor, w: torch.Tensor, sh: torch.Tensor | None, g: torch.Tensor | None
    ) -> torch.Tensor:
        return _torch_moe.moe_weighted_sum(
            y, w, topk_ids, shared_out=sh, shared_gate=g, out_dtype=out_dtype
        )

    return with_torch_backward(  # type: ignore[return-value]
        run, ref, expert_out, topk_weights, shared_out, shared_gate
    )


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    first_expert: int = 0,
) -> torch.Tensor:
    """Expert outputs [T, k, H]: y = w2[e] · silu_mul(w13[e] · x) per (t, slot), each row with
    the bits of the row-invariant Triton `linear` of its expert (`moe_experts_by_expert`).
    Experts outside `first_expert ..` leave their slots -0.0 (see the torch `moe_experts`).

    One grouped launch per GEMM with the routing on the device (`moe_grouped`): no host sync,
    so the op runs inside a CUDA graph. Backward: the per-expert loop's, under autograd.
    """

    def run(a: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return grouped_experts(a, topk_ids, w_up, w_down, silu_mul, first_expert=first_expert)

    def ref(a: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return moe_experts_by_expert(a, topk_ids, w_up, w_down, first_expert=first_expert)

    return with_torch_backward(run, ref, x, w13, w2)  # type: ignore[return-value]


def moe_experts_by_expert(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    first_expert: int = 0,
) -> torch.Tensor:
    """The same outputs by a loop over the routed experts in ascending id, each over the tokens
    routed to it. It reads the routing on the host (not CUDA-graph safe): the reference the
    grouped launch is checked against, and the differentiable path of its backward."""
    t, k = topk_ids.shape
    out = x.new_full((t, k, w2.shape[1]), -0.0)
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        if not first_expert <= e < first_expert + w13.shape[0]:
            continue
        sel = (flat == e).nonzero().squeeze(-1)
        tok, slot = sel // k, sel % k
        h = silu_mul(linear(x[tok], w13[e - first_expert]))
        out = out.index_put((tok, slot), linear(h, w2[e - first_expert]))
    return out


def moe_combine(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_gate_w: torch.Tensor | None = None,
    expert_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full MoE block after routing (same contract as the torch canonical `moe_combine`,
    `expert_out` included)."""
    y = moe_experts(x, topk_ids, w13, w2) if expert_out is None else expert_out
    shared_out = shared_gate = None
    if shared_w13 is not None and shared_w2 is not None:
        shared_out = linear(silu_mul(linear(x, shared_w13)), shared_w2)
        if shared_gate_w is not None:
            shared_gate = linear(x, shared_gate_w)
    return moe_weighted_sum(
        y, topk_weights, topk_ids, shared_out=shared_out, shared_gate=shared_gate, out_dtype=x.dtype
    )
