"""The compiled RoPE apply (`cpu_kernels/rope.cpp`): the torch formula's bits (`rope.apply_rope`
is unchanged at v1), in any layout and at any thread count, and `apply_rope_at` (the table row
picked by position inside the kernel) equals the lookup followed by the apply.

Negative control: the same arithmetic with its multiply and subtract fused (what a compiler
allowed to contract `x1*c - x2*s` into an FMA would emit) gives other bits, so the build's
`-ffp-contract=off` is what keeps the kernel on the formula.
"""

from __future__ import annotations

import pytest
import torch
from _ops_testlib import num_threads

from isoexec.ops import apply_rope, apply_rope_at, rope
from isoexec.ops.rope import rope_cos_sin_table

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _x(tokens, heads, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, heads, d, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "rot"), [(64, 64), (128, 32), (256, 64), (6, 4)])
def test_the_kernel_gives_the_formulas_bits(dtype, d, rot):
    x = _x(29, 3, d, dtype)
    pos = torch.randint(0, 9000, (29,), generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin_table(pos, rot, 1e6)
    want = rope._apply_rope_torch(x, cos, sin, rot)
    assert torch.equal(apply_rope(x, cos, sin, rot), want)
    assert torch.equal(apply_rope_at(x, pos, rot, 1e6), want)
    # vLLM's q heads: a [T, H, D] view of the wider QKV output
    qkv = _x(29, 3 * 3, d, dtype, seed=2).reshape(29, -1)
    q = qkv[:, 3 * d : 6 * d].view(29, 3, d)
    assert not q.is_contiguous()
    assert torch.equal(apply_rope_at(q, pos, rot, 1e6), rope._apply_rope_torch(q, cos, sin, rot))


def test_rows_are_invariant_to_threads_and_positions_past_the_table():
    x = _x(700, 4, 128, torch.bfloat16, seed=3)  # enough tokens to split over threads
    pos = torch.arange(700) * 13  # past the first table's 4096 positions: the table grows
    with num_threads(1):
        one = apply_rope_at(x, pos, 128, 1e6)
    with num_threads(2):
        two = apply_rope_at(x, pos, 128, 1e6)
    assert torch.equal(one, two)
    alone = [apply_rope_at(x[i : i + 1], pos[i : i + 1], 128, 1e6) for i in (0, 350, 699)]
    assert all(torch.equal(a, one[i : i + 1]) for a, i in zip(alone, (0, 350, 699), strict=True))
    # a negative position has no table row: computed by itself, the same formula
    neg = torch.tensor([-3, 5])
    cos, sin = rope.rope_cos_sin(neg, 128, 1e6)
    got = apply_rope_at(x[:2], neg, 128, 1e6)
    assert torch.equal(got, rope._apply_rope_torch(x[:2], cos, sin, 128))


def test_the_backward_goes_through_the_formula():
    x = _x(5, 2, 64, torch.float32).requires_grad_()
    cos, sin = rope.rope_cos_sin(torch.arange(5), 64, 1e4)
    (apply_rope(x, cos, sin, 64) * torch.arange(640.0).reshape(5, 2, 64)).sum().backward()
    x64 = x.detach().double().requires_grad_()
    ref = rope._apply_rope_torch(x64, cos.double(), sin.double(), 64)
    (ref * torch.arange(640.0).double().reshape(5, 2, 64)).sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-4)


def test_negative_control_a_fused_multiply_subtract_gives_other_bits():
    x = _x(64, 4, 128, torch.float32, seed=4)
    pos = torch.arange(64) * 7
    cos, sin = rope_cos_sin_table(pos, 128, 1e6)
    ours = apply_rope_at(x, pos, 128, 1e6)
    x1, x2 = x[..., :64].double(), x[..., 64:].double()
    c, s = cos[:, None, :].double(), sin[:, None, :].double()
    # fma(x1, c, -(x2 * s)): the product x1*c kept exact (fp64 holds it), one rounding at the end
    fused = (x1 * c - (x2.float() * s.float()).double()).float()
    differ = int((fused != ours[..., :64]).sum())
    print(f"a contracted multiply-subtract: {differ} of {fused.numel()} elements differ")
    assert differ > 0


def test_what_the_kernel_cannot_run_is_refused():
    x = _x(3, 2, 8, torch.float32)
    cos, sin = rope.rope_cos_sin(torch.arange(3), 8, 1e4)
    with pytest.raises(ValueError, match="rotary_dim 5"):
        apply_rope(x, cos, sin, 5)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rope(x, cos[:2], sin[:2], 8)
