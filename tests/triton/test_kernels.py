"""Every Triton kernel: bitwise row invariance (batch size, neighbours, decode split, TP
shards) and accuracy against the torch canonical op; backward passes are correct.

Runs on CUDA, or on CPU under the interpreter (see _triton_testlib); the checks themselves
live in `isoexec.contract.ops.triton.selfcheck` so the GPU script runs the same ones.
"""

from __future__ import annotations

import pytest
import torch
from _triton_testlib import DEVICE, kernel_marks

pytestmark = kernel_marks()

from isoexec.contract.ops import triton as xops  # noqa: E402
from isoexec.contract.ops.triton.selfcheck import CHECKS, DTYPES, TOLERANCE  # noqa: E402


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


def test_backward_gdn_matches_torch_op() -> None:
    from isoexec.contract.ops import gdn_recurrence

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
