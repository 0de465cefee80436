"""Every Triton kernel: bitwise row invariance (batch size, neighbours, decode split, TP
shards) and accuracy against the torch canonical op; backward passes are correct.

Runs on CUDA, or on CPU under the interpreter (see _triton_testlib); the checks themselves
live in `isoexec.ops.triton.selfcheck` so the GPU script runs the same ones.
"""

from __future__ import annotations

import pytest
import torch
from _triton_testlib import DEVICE, kernel_marks

pytestmark = kernel_marks()

from isoexec.ops import gemm as t_gemm  # noqa: E402
from isoexec.ops import triton as xops  # noqa: E402
from isoexec.ops.triton.selfcheck import (  # noqa: E402
    CHECKS,
    DTYPES,
    TOLERANCE,
    linear_tp_shard_ranks,
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CHECKS))
def test_invariant_and_accurate(name: str, dtype: torch.dtype) -> None:
    r = CHECKS[name](DEVICE, dtype, 1)
    assert r.invariant, f"{name} {dtype}: not bitwise invariant: {r.detail}"
    rtol, atol = TOLERANCE[dtype]
    assert r.accurate, (
        f"{name} {dtype}: error {r.max_err:.3g} x tolerance (rtol {rtol}, atol {atol})"
    )


def _grad_close(
    fn, ref, inputs: list[torch.Tensor], rtol: float = 1e-4, atol: float = 1e-5
) -> None:
    """Grads of sum(fn * u) match the float64 reference's."""

    def grads(f, ins):
        ins = [t.detach().clone().requires_grad_() for t in ins]
        y = f(*ins)
        u = torch.randn(y.shape, generator=torch.Generator().manual_seed(0)).to(y)
        (y * u).sum().backward()
        return [t.grad for t in ins]

    got = grads(fn, [t.float().to(DEVICE) for t in inputs])
    want = grads(ref, [t.double().to(DEVICE) for t in inputs])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol)


def test_backward_linear_norm_rope_silu() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 24, generator=g), torch.randn(16, 24, generator=g)
    _grad_close(xops.linear, lambda a, b: a @ b.T, [x, w])
    nw = torch.randn(24, generator=g)

    def rms64(a, b):
        return a * torch.rsqrt((a * a).mean(-1, keepdim=True) + 1e-6) * b

    _grad_close(lambda a, b: xops.rms_norm(a, b, 1e-6), rms64, [x, nw])
    y = torch.randn(5, 2 * 12, generator=g)
    _grad_close(xops.silu_mul, lambda a: torch.nn.functional.silu(a[..., :12]) * a[..., 12:], [y])
    xr = torch.randn(5, 2, 16, generator=g)
    c, s = xops.rope_cos_sin(torch.arange(5), 16, 10000.0)

    def rope64(a):
        a1, a2 = a[..., :8], a[..., 8:]
        cc, ss = c.double().to(a.device)[:, None], s.double().to(a.device)[:, None]
        return torch.cat([a1 * cc - a2 * ss, a2 * cc + a1 * ss], -1)

    _grad_close(lambda a: xops.apply_rope(a, c.to(a.device), s.to(a.device)), rope64, [xr])


def test_backward_attention_logprobs() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 7], device=DEVICE)

    def attn64(a, b, c):
        outs = []
        for s, e in ((0, 3), (3, 7)):
            sc = (a[s:e].transpose(0, 1) @ b[s:e].permute(1, 2, 0)) * 8**-0.5
            mask = torch.ones(e - s, e - s, dtype=torch.bool, device=a.device).tril()
            p = sc.masked_fill(~mask, float("-inf")).softmax(-1)
            outs.append((p @ c[s:e].transpose(0, 1)).transpose(0, 1))
        return torch.cat(outs)

    _grad_close(
        lambda a, b, c: xops.attention_varlen(a, b, c, cu, scale=8**-0.5), attn64, [q, k, v]
    )
    logits = torch.randn(4, 50, generator=g)
    ids = torch.tensor([3, 0, 49, 7], device=DEVICE)
    _grad_close(
        lambda x: xops.token_logprobs(x, ids, temperature=0.7),
        lambda x: torch.log_softmax(x / 0.7, -1).gather(-1, ids[:, None])[:, 0],
        [logits],
    )


def test_backward_never_needs_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the torch backend's compiled CPU kernels cannot run, so a Triton op's backward
    must differentiate a device-agnostic reference: with the kernels made unavailable, the
    attention and GDN backwards still give the reference gradients."""
    from isoexec.ops import cpu_kernels

    def unavailable(name: str) -> None:
        raise RuntimeError(f"the {name} CPU kernel was called from a Triton backward")

    monkeypatch.setattr(cpu_kernels, "library", unavailable)
    test_backward_attention_logprobs()
    g = torch.Generator().manual_seed(2)
    shapes = ((4, 1, 8), (4, 1, 8), (4, 2, 8), (4, 2), (4, 2), (2,), (2,))
    ins = [torch.randn(*s, generator=g).requires_grad_() for s in shapes]
    got = torch.autograd.grad(xops.gdn_recurrence(*ins)[0].sum(), ins)
    monkeypatch.undo()
    from isoexec.ops import gdn_recurrence

    want = torch.autograd.grad(gdn_recurrence(*ins)[0].sum(), ins)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_backward_gdn_matches_torch_op() -> None:
    from isoexec.ops import gdn_recurrence

    g = torch.Generator().manual_seed(2)
    ins = [
        torch.randn(4, 1, 8, generator=g),
        torch.randn(4, 1, 8, generator=g),
        torch.randn(4, 2, 8, generator=g),
        torch.randn(4, 2, generator=g),
        torch.randn(4, 2, generator=g),
        torch.randn(2, generator=g),
        torch.randn(2, generator=g),
    ]
    _grad_close(
        lambda *a: xops.gdn_recurrence(*a)[0],
        lambda *a: gdn_recurrence(*[t.float() for t in a])[0].double(),
        ins,
        rtol=1e-4,
        atol=1e-4,
    )


# ---- the TP-invariant linear's shard form, and its gradients ---------------------------------
def _tp_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 64, generator=g)).to(dtype).to(DEVICE)  # lead dims kept
    w = (torch.randn(24, 64, generator=g) * 0.2).to(dtype).to(DEVICE)
    bias = torch.randn(24, generator=g).to(dtype).to(DEVICE)
    return x, w, bias


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_tp_shard_is_linear_tp_invariant_at_every_tp(dtype: torch.dtype) -> None:
    """TP=1 shard == `linear_tp_invariant` bitwise; at TP=2 and 4 (K-shards, the leaves
    gathered in rank order by a fake exact all-gather, torch.cat along dim 0) every rank's
    output is those bits too."""
    x, w, bias = _tp_inputs(dtype)
    whole = xops.linear_tp_invariant(x, w, bias)
    assert whole.shape == (2, 3, 24) and whole.dtype == dtype
    assert torch.equal(xops.linear_tp_shard(x, w, bias, tp=1), whole)
    for tp in (2, 4):
        ranks = linear_tp_shard_ranks(
            xops.linear_tp_shard, xops.tp_leaf_partials, x, w, bias, tp=tp, leaves=8
        )
        for r, y in enumerate(ranks):
            assert torch.equal(y, whole), f"TP={tp} rank {r}"
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(
        whole.double(), t_gemm.linear_tp_shard(x, w, bias, tp=1).double(), rtol=rtol, atol=atol
    )
    with pytest.raises(ValueError, match="needs the group's all_gather"):
        xops.linear_tp_shard(x[..., :32], w[:, :32], tp=2)
    with pytest.raises(ValueError, match="returned 4 leaves, expected 8"):
        xops.linear_tp_shard(x[..., :32], w[:, :32], tp=2, all_gather=lambda p: p)
    with pytest.raises(ValueError, match="not divisible by TP=3"):
        xops.linear_tp_shard(x, w, tp=3, all_gather=lambda p: p)

    def detached(p: torch.Tensor) -> torch.Tensor:  # an all-gather outside autograd
        return torch.cat([p, p]).detach()

    xg = x[..., :32].detach().requires_grad_()
    with pytest.raises(RuntimeError, match="dropped the leaves' autograd graph"):
        xops.linear_tp_shard(xg, w[:, :32], tp=2, all_gather=detached)
    with torch.no_grad():  # the engine's case: no autograd, nothing to drop
        xops.linear_tp_shard(xg, w[:, :32], tp=2, all_gather=detached)


def _old_forward_only_linear_tp(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, leaves: int = 8
) -> torch.Tensor:
    """Negative control: the leaves as the Triton module computed them before they had a
    backward (the bare kernel per leaf, no autograd), then the same tree sum."""
    x2, wf = x.reshape(-1, x.shape[-1]).float(), w.float()
    kl = x2.shape[1] // leaves
    parts = torch.stack(
        [
            xops.gemm.gemm(
                x2[:, i * kl : (i + 1) * kl], wf[:, i * kl : (i + 1) * kl], out_dtype=torch.float32
            )
            for i in range(leaves)
        ]
    )
    return t_gemm._tree_sum_round(parts, bias, x, w.shape[0])


def _grads(fn, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor):
    """(output, grads of sum(out * u) w.r.t. x, w, bias: None where none reached them)."""
    ins = [t.detach().clone().requires_grad_() for t in (x, w, bias)]
    y = fn(*ins)
    if y.requires_grad:
        u = torch.randn(y.shape, generator=torch.Generator().manual_seed(0)).to(y)
        (y * u).sum().backward()
    return y, [t.grad for t in ins]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_tp_gradients_equal_the_torch_canonical_ops(dtype: torch.dtype) -> None:
    """x.grad, weight.grad, bias.grad of the Triton TP forms (the shard at TP=1 and at TP=2
    through a fake exact gather, `linear_tp_invariant`, `tp_linear_from_shards`) exist and
    equal the torch canonical op's; the old forward-only leaves drop x's and w's gradient
    (the bias still had one, so `y.requires_grad` alone would not have caught it)."""
    x, w, bias = _tp_inputs(dtype)
    _, want = _grads(lambda a, b, c: t_gemm.linear_tp_shard(a, b, c, tp=1), x, w, bias)
    assert all(g is not None for g in want)

    def tp2(a, b, c):  # both ranks' leaves in one graph: rank 0's output, rank 1's gathered
        ranks = linear_tp_shard_ranks(
            xops.linear_tp_shard, xops.tp_leaf_partials, a, b, c, tp=2, leaves=8
        )
        return ranks[0]

    forms = {
        "shard TP=1": lambda a, b, c: xops.linear_tp_shard(a, b, c, tp=1),
        "shard TP=2": tp2,
        "linear_tp_invariant": xops.linear_tp_invariant,
        "tp_linear_from_shards TP=4": lambda a, b, c: xops.tp_linear_from_shards(
            list(a.chunk(4, -1)), list(b.chunk(4, -1)), c
        ),
    }
    for name, fn in forms.items():
        y, got = _grads(fn, x, w, bias)
        assert y.grad_fn is not None, name
        for what, a, b in zip(("x", "weight", "bias"), got, want, strict=True):
            assert a is not None, f"{name}: no {what}.grad"
            assert a.dtype == b.dtype and a.shape == b.shape, (name, what)
            torch.testing.assert_close(a, b, msg=f"{name}: {what}.grad")

    # Negative control: the same checks on the old path fail where they should.
    y, got = _grads(_old_forward_only_linear_tp, x, w, bias)
    assert torch.equal(y, xops.linear_tp_invariant(x, w, bias))  # same forward bits
    assert y.requires_grad  # through the bias only
    assert got[0] is None and got[1] is None and got[2] is not None
    y, _ = _grads(lambda a, b, c: _old_forward_only_linear_tp(a, b, None), x, w, bias)
    assert y.grad_fn is None  # no bias: nothing left to differentiate


def test_tp_leaf_partials_have_the_torch_leaves_backward() -> None:
    """The leaves alone: the torch canonical leaves' gradients; no graph under no_grad."""
    x, w, _ = _tp_inputs()
    u = torch.randn(4, 6, 24, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = []
    for leaves_fn in (t_gemm.tp_leaf_partials, xops.tp_leaf_partials):
        a, b = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        (leaves_fn(a, b, leaves=4) * u).sum().backward()
        grads.append((a.grad, b.grad))
    (twx, tww), (xgx, xgw) = grads
    assert xgx is not None and xgw is not None
    torch.testing.assert_close(xgx, twx)
    torch.testing.assert_close(xgw, tww)
    with torch.no_grad():
        assert xops.tp_leaf_partials(x.detach().requires_grad_(), w, leaves=4).grad_fn is None
