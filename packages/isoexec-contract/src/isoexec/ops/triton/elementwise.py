"""Triton rotary embedding (apply) and SiLU-and-multiply.

Why: both are elementwise, so every element's bits depend only on its own inputs as long as
every element runs the same instructions — true of a GPU kernel whatever the shape (the CPU
tail-vs-SIMD problem of the torch ops does not exist here). All maths in fp32, one rounding.
The rope table is the torch canonical `rope_cos_sin` (elementwise cos/sin on the device,
built once per position and shared by both sides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import activation as _torch_act
from .. import rope as _torch_rope
from ._runtime import check_device, pow2, store_rounded, with_torch_backward

SILU_BLOCK = 1024

rope_cos_sin = _torch_rope.rope_cos_sin
rope_inv_freq = _torch_rope.rope_inv_freq


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    H,
    D,
    HALF,
    ROT,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * H + h) * D
    i = tl.arange(0, BLOCK_HALF)
    ok = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + i, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + i, mask=ok, other=0.0).to(tl.float32)
    store_rounded(y_ptr + base + i, x1 * c - x2 * s, ok)
    store_rounded(y_ptr + base + HALF + i, x2 * c + x1 * s, ok)
    if BLOCK_PASS > 0:
        p = ROT + tl.arange(0, BLOCK_PASS).to(tl.int64)
        pok = p < D
        tl.store(y_ptr + base + p, tl.load(x_ptr + base + p, mask=pok), mask=pok)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None
) -> torch.Tensor:
    """Neox rotate-half of the first `rotary_dim` dims of x [T, ..., D]; same contract as the
    torch canonical `apply_rope`. cos/sin [T, rotary_dim // 2] fp32."""

    def run(a: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        check_device(a)
        t, d = a.shape[0], a.shape[-1]
        rot = d if rotary_dim is None else rotary_dim
        a3 = a.reshape(t, -1, d).contiguous()
        y = torch.empty_like(a3)
        if a3.numel():
            _rope_kernel[(t, a3.shape[1])](
                a3,
                c.float().contiguous(),
                s.float().contiguous(),
                y,
                a3.shape[1],
                d,
                rot // 2,
                rot,
                BLOCK_HALF=pow2(rot // 2),
                BLOCK_PASS=0 if rot == d else pow2(d - rot),
            )
        return y.reshape(a.shape)

    def ref(a: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _torch_rope.apply_rope(a, c, s, rotary_dim)

    return with_torch_backward(run, ref, x, cos, sin)  # type: ignore[return-value]


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inner
    g = tl.load(x_ptr + row * 2 * inner + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * inner + inner + col, mask=ok, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    store_rounded(y_ptr + row * inner + col, silu * u, ok)


def silu_mul(x: torch.Tensor, *, block: int = SILU_BLOCK) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] in fp32, rounded once to x's dtype."""

    def run(a: torch.Tensor) -> torch.Tensor:
        check_device(a)
        i = a.shape[-1] // 2
        a2 = a.reshape(-1, 2 * i).contiguous()
        y = torch.empty(a2.shape[0], i, dtype=a.dtype, device=a.device)
        if y.numel():
            _silu_mul_kernel[(a2.shape[0], triton.cdiv(i, block))](a2, y, i, BLOCK=block)
        return y.reshape(*a.shape[:-1], i)

    return with_torch_backward(run, _torch_act.silu_mul, x)  # type: ignore[return-value]
