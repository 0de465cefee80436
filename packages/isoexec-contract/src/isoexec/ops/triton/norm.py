"""Triton RMSNorm (plain, zero-centred `1+w`, fused residual add) and gated RMSNorm.

Why: one program per row reduces that row alone, in fp32, over a fixed power-of-two width
(`tl.sum`'s tree depends only on that width), so a row's bits do not depend on how many rows
run. `1/sqrt` uses IEEE `sqrt_rn` and `div_rn` (not the approximate rsqrt), the weight is
applied in fp32, one rounding at the end. The fused residual add rounds `x + residual` to
x's dtype first, like the torch op (so the residual stream is bitwise the torch one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import norm as _torch_norm
from ._runtime import check_device, pow2, rounded_like, store_rounded, with_torch_backward


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    rout_ptr,
    D,
    eps,
    BLOCK_D: tl.constexpr,
    HAS_RES: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        # torch: x + residual.to(x.dtype), computed in fp32 and rounded to x's dtype
        r = tl.load(res_ptr + row * D + offs, mask=ok, other=0.0)
        r = r.to(rout_ptr.dtype.element_ty).to(tl.float32)
        x = rounded_like(x + r, rout_ptr)
        store_rounded(rout_ptr + row * D + offs, x, ok)
    var = tl.math.div_rn(tl.sum(x * x, axis=0), D * 1.0)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    store_rounded(y_ptr + row * D + offs, (x * rstd) * w, ok)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    var = tl.math.div_rn(tl.sum(x * x, axis=0), D * 1.0)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(z, 1.0 + tl.exp(-z))
    store_rounded(y_ptr + row * D + offs, ((x * rstd) * w) * silu, ok)


def _rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    eps: float,
    zero_centered: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    check_device(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    rout = torch.empty_like(x2) if residual is not None else y
    res = residual.reshape(-1, d).contiguous() if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res,
            weight.contiguous(),
            y,
            rout,
            d,
            float(eps),
            BLOCK_D=pow2(d),
            HAS_RES=residual is not None,
            ZERO_CENTERED=zero_centered,
        )
    if residual is None:
        return y.reshape(x.shape)
    return y.reshape(x.shape), rout.reshape(x.shape)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the torch canonical `rms_norm` (returns `(norm(r), r)` with
    `residual`); backward through the torch op."""

    def run(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> object:
        return _rms_norm_fwd(a, w, r, eps, zero_centered)

    def ref(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> object:
        return _torch_norm.rms_norm(a, w, eps, zero_centered=zero_centered, residual=r)

    return with_torch_backward(run, ref, x, weight, residual)  # type: ignore[return-value]


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`norm(x) * w * silu(z)` in fp32, one rounding; backward through the torch op."""

    def run(a: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        check_device(a)
        d = a.shape[-1]
        a2 = a.reshape(-1, d).contiguous()
        y = torch.empty_like(a2)
        if a2.shape[0]:
            _gated_rms_norm_kernel[(a2.shape[0],)](
                a2,
                g.reshape(-1, d).contiguous(),
                w.contiguous(),
                y,
                d,
                float(eps),
                BLOCK_D=pow2(d),
            )
        return y.reshape(a.shape)

    def ref(a: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _torch_norm.gated_rms_norm(a, g, w, eps)

    return with_torch_backward(run, ref, x, z, weight)  # type: ignore[return-value]
