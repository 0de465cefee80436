"""Canonical RMSNorm (plain, zero-centred `1+w`, fused residual add) and gated RMSNorm.

Why: per row in fp32 with a contiguous last-dim mean (row-invariant on CPU), rsqrt through
the position-invariant `pointwise`, weight applied in fp32, one rounding at the end. The
fused residual add is done in the input dtype, the same way on both sides.
"""

from __future__ import annotations

import torch

from . import _pointwise as pw


def _normalize(x32: torch.Tensor, eps: float) -> torch.Tensor:
    var = (x32 * x32).mean(-1, keepdim=True)
    return x32 * pw.rsqrt(var + eps)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: `x / rms(x) * w` (or `* (1 + w)` if zero_centered).

    With `residual`, computes `r = x + residual` in x's dtype and returns `(norm(r), r)`,
    the fused form vLLM uses (Megatron adds the residual itself; it must add in x's dtype).
    """
    new_residual = None
    if residual is not None:
        x = x + residual.to(x.dtype)
        new_residual = x
    w = weight.float()
    if zero_centered:
        w = w + 1.0
    y = (_normalize(x.float(), eps) * w).to(x.dtype)
    return y if new_residual is None else (y, new_residual)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`norm(x) * w * silu(z)`, all in fp32, one rounding (HF Qwen3-Next RMSNormGated).

    HF rounds norm(x) to the input dtype before the weight; the canonical op does not.
    """
    y = _normalize(x.float(), eps) * weight.float()
    return (y * pw.silu(z.float())).to(x.dtype)
