"""Canonical MoE: router (fp32 softmax, top-k with ties to the lower expert index) and
experts + combine (canonical linears, ascending-expert fixed-order fp32 sum, one rounding).

Why: a token's output must not depend on which other tokens share its experts. Expert
GEMMs are the row-invariant canonical `linear`; the weighted sum over a token's k experts
runs in ascending expert id in fp32 and is rounded once; the shared expert (sigmoid-gated)
is added last. Expert weights are stacked as vLLM and transformers 5 hold them:
w13 [E, 2I, H] = cat(gate, up) and w2 [E, H, I].
"""

from __future__ import annotations

import torch

from . import _pointwise as pw
from .activation import silu_mul
from .gemm import DEFAULT_BLOCK_ROWS, linear


def moe_router(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k]) from router logits [T, E].

    softmax over all E in fp32, then the k largest probabilities (a stable descending sort:
    equal probabilities go to the lower expert index), optionally renormalised to sum 1.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    _, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    ids = order[..., :top_k]
    w = probs.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def moe_weighted_sum(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fixed-order combine: sum_j w_j * y_j over a token's experts in ascending expert id,
    in fp32, then `+ sigmoid(shared_gate) * shared_out` (if given), rounded once.

    expert_out [T, k, H] is the output of expert topk_ids[t, j] for token t (slot j);
    shared_gate [T, 1] holds the shared expert's gate logit.
    """
    order = torch.argsort(topk_ids, dim=-1, stable=True)
    w = topk_weights.float().gather(-1, order)
    y = expert_out.gather(1, order[..., None].expand_as(expert_out)).float()
    acc = w[:, 0, None] * y[:, 0]
    for j in range(1, y.shape[1]):
        acc = acc + w[:, j, None] * y[:, j]
    if shared_out is not None:
        sh = shared_out.float()
        if shared_gate is not None:
            sh = pw.sigmoid(shared_gate.float()) * sh
        acc = acc + sh
    return acc.to(out_dtype or expert_out.dtype)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    first_expert: int = 0,
) -> torch.Tensor:
    """Expert outputs [T, k, H] (x's dtype): y = w2[e] · silu_mul(w13[e] · x) per (t, slot),
    experts visited in ascending id, each over the tokens routed to it (row-invariant).

    x is [T, H], or [T, k, H] with one input row per (token, slot) (all equal to the token's
    row): the same outputs, and under autograd each slot's input gradient stays its own, so a
    trainer can sum a token's k slot gradients in a fixed order wherever the experts ran.

    Expert parallelism: `w13`/`w2` may hold only experts `first_expert ..` (a rank's local
    experts). A slot routed elsewhere is -0.0, the exact additive identity (x + -0.0 == x for
    every x, signed zeros included), so summing the ranks' outputs in any order reassembles
    every slot bit for bit.
    """
    t, k = topk_ids.shape
    out = x.new_full((t, k, w2.shape[1]), -0.0)
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        if not first_expert <= e < first_expert + w13.shape[0]:
            continue
        sel = (flat == e).nonzero().squeeze(-1)
        tok, slot = sel // k, sel % k
        rows = x[tok] if x.dim() == 2 else x[tok, slot]
        h = silu_mul(linear(rows, w13[e - first_expert], block_rows=block_rows))
        out = out.index_put((tok, slot), linear(h, w2[e - first_expert], block_rows=block_rows))
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
    block_rows: int = DEFAULT_BLOCK_ROWS,
    expert_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full MoE block after routing: routed experts + fixed-order combine + optional shared
    expert `sigmoid(x · shared_gate_w^T) * w2s · silu_mul(w13s · x)`. x [T, H] -> [T, H].

    `expert_out` [T, k, H]: the routed experts' outputs, already computed (under expert
    parallelism they come from the ranks holding the experts); `w13`/`w2` are then unused."""
    y = (
        moe_experts(x, topk_ids, w13, w2, block_rows=block_rows)
        if expert_out is None
        else expert_out
    )
    shared_out = shared_gate = None
    if shared_w13 is not None and shared_w2 is not None:
        shared_out = linear(
            silu_mul(linear(x, shared_w13, block_rows=block_rows)),
            shared_w2,
            block_rows=block_rows,
        )
        if shared_gate_w is not None:
            shared_gate = linear(x, shared_gate_w, block_rows=block_rows)
    return moe_weighted_sum(
        y,
        topk_weights,
        topk_ids,
        shared_out=shared_out,
        shared_gate=shared_gate,
        out_dtype=x.dtype,
    )
