"""MoE: router ties and renormalisation, a token's output independent of which other tokens
share its experts (and of threads), accuracy, backward; native F.linear experts differ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import assert_grads_match_float64, assert_row_invariant, assert_row_variant

from isoexec.contract.ops import moe_combine, moe_router, moe_weighted_sum

E, TOPK, HID, INTER = 8, 2, 256, 96


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, HID, generator=g) * HID**-0.5).to(dtype)
    w2 = (torch.randn(E, HID, INTER, generator=g) * INTER**-0.5).to(dtype)
    wr = torch.randn(E, HID, generator=g).to(dtype)
    sh13 = (torch.randn(2 * INTER, HID, generator=g) * HID**-0.5).to(dtype)
    sh2 = (torch.randn(HID, INTER, generator=g) * INTER**-0.5).to(dtype)
    shg = torch.randn(1, HID, generator=g).to(dtype)
    return w13, w2, wr, sh13, sh2, shg


def _block(dtype, shared=True):
    w13, w2, wr, sh13, sh2, shg = _weights(dtype)

    def fn(x):
        w, ids = moe_router(x.float() @ wr.float().T, TOPK, renormalize=True)
        kw = dict(shared_w13=sh13, shared_w2=sh2, shared_gate_w=shg) if shared else {}
        return moe_combine(x, w, ids, w13, w2, **kw)

    return fn


def _gen(dtype):
    def gen(m, g):
        return (torch.randn(m, HID, generator=g).to(dtype),)

    return gen


def test_router_ties_go_to_lower_index_and_renormalise():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    w, ids = moe_router(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(w, torch.softmax(logits, -1).gather(-1, ids))
    w, _ = moe_router(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(2)) and w.dtype == torch.float32
    assert_row_invariant(
        lambda x: torch.cat([t.float() for t in moe_router(x, 3, renormalize=True)], -1),
        lambda m, g: (torch.randn(m, 60, generator=g),),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_independent_of_other_tokens(dtype):
    assert_row_invariant(_block(dtype), _gen(dtype), sizes=(1, 2, 7, 16, 64))


def test_negative_control_native_experts_differ():
    """HF-style experts (F.linear over each expert's gathered tokens) depend on how many
    tokens the expert got."""
    w13, w2, wr, *_ = _weights(torch.float32)

    def naive(x):
        w, ids = moe_router(x @ wr.T, TOPK, renormalize=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            h = F.linear(x[tok], w13[e])
            y = F.linear(F.silu(h[:, :INTER]) * h[:, INTER:], w2[e])
            out = out.index_add(0, tok, y * w[tok, slot, None])
        return out

    assert_row_variant(naive, _gen(torch.float32), sizes=(1, 2, 7, 16, 64))


def test_weighted_sum_is_ascending_expert_order():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 2, 8, generator=g)
    w = torch.rand(3, 2, generator=g)
    ids = torch.tensor([[5, 1], [0, 3], [7, 2]])
    got = moe_weighted_sum(y, w, ids)
    swapped = moe_weighted_sum(y.flip(1), w.flip(1), ids.flip(1))
    assert torch.equal(got, swapped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_vs_float64(dtype):
    w13, w2, wr, sh13, sh2, shg = _weights(dtype)
    x = torch.randn(20, HID, generator=torch.Generator().manual_seed(2)).to(dtype)
    w, ids = moe_router(x.float() @ wr.float().T, TOPK, renormalize=True)
    got = moe_combine(x, w, ids, w13, w2, shared_w13=sh13, shared_w2=sh2, shared_gate_w=shg)
    xd = x.double()

    def mlp(a, b, c):
        h = a @ b.double().T
        return (F.silu(h[:, :INTER]) * h[:, INTER:]) @ c.double().T

    ref = torch.sigmoid(xd @ shg.double().T) * mlp(xd, sh13, sh2)
    for t in range(20):
        for j in range(TOPK):
            e = int(ids[t, j])
            ref[t] += w[t, j].double() * mlp(xd[t : t + 1], w13[e], w2[e])[0]
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert (got.double() - ref).abs().max() < tol


def test_backward_matches_float64():
    w13, w2, wr, *_ = _weights(torch.float32)
    x = torch.randn(6, HID, generator=torch.Generator().manual_seed(3))
    w, ids = moe_router(x @ wr.T, TOPK, renormalize=True)

    def ref(x, w13, w2):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(TOPK):
                e = int(ids[t, j])
                h = x[t] @ w13[e].T
                out[t] = out[t] + w[t, j].double() * ((F.silu(h[:INTER]) * h[INTER:]) @ w2[e].T)
        return out

    assert_grads_match_float64(lambda x, a, b: moe_combine(x, w, ids, a, b), ref, (x, w13, w2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_split_outputs_reassemble_exactly(dtype):
    """Expert parallelism's exchange: each half of the experts fills its slots and leaves -0.0
    elsewhere; the halves' sum (either order) is the whole-expert output bit for bit, signed
    zeros included, and `moe_combine(expert_out=...)` on it equals `moe_combine`."""
    from isoexec.contract.ops import moe_experts

    w13, w2, wr, sh13, sh2, shg = _weights(dtype)
    x = torch.randn(37, HID, generator=torch.Generator().manual_seed(3)).to(dtype)
    w, ids = moe_router(x.float() @ wr.float().T, TOPK, renormalize=True)
    whole = moe_experts(x, ids, w13, w2)
    lo = moe_experts(x, ids, w13[: E // 2], w2[: E // 2], first_expert=0)
    hi = moe_experts(x, ids, w13[E // 2 :], w2[E // 2 :], first_expert=E // 2)
    for total in (lo + hi, hi + lo):
        assert torch.equal(total, whole)
        assert torch.equal(torch.signbit(total), torch.signbit(whole))
    assert torch.equal(
        torch.signbit(lo[ids >= E // 2]), torch.ones_like(lo[ids >= E // 2], dtype=torch.bool)
    )
    kw = dict(shared_w13=sh13, shared_w2=sh2, shared_gate_w=shg)
    assert torch.equal(
        moe_combine(x, w, ids, w13, w2, expert_out=lo + hi, **kw),
        moe_combine(x, w, ids, w13, w2, **kw),
    )
    # A slot whose expert output is +0.0 keeps it: -0.0 + 0.0 is +0.0, not -0.0.
    assert torch.equal(torch.signbit(torch.tensor(-0.0) + torch.tensor(0.0)), torch.tensor(False))
