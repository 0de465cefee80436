"""Canonical RMSNorm (plain, zero-centred `1+w`, fused residual add) and gated RMSNorm.

Why: per row in fp32, weight applied in fp32, one rounding at the end; the fused residual add
is done in the input dtype, the same way on both sides. On CPU `rms_norm` is one compiled
loop per row (`cpu_kernels/norm.cpp`, v2: its sum of squares in 16 lanes and a fixed tree, so
its bits are the source's); its backward goes through the torch formula (`_rms_norm_torch`),
which also runs on other devices (a contract records the device). The torch formula takes a
contiguous last-dim mean (row-invariant) and rsqrt through the position-invariant `pointwise`.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from . import _pointwise as pw
from . import cpu_kernels
from ._autograd import with_torch_backward

# The compiled CPU kernels this module runs (their sources are part of its ops' fingerprint).
KERNEL_LIBRARIES = ("norm",)


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
    if x.device.type != "cpu":
        return _rms_norm_torch(x, weight, eps, zero_centered=zero_centered, residual=residual)
    _check_cpu(x, weight, residual)
    if residual is not None and residual.dtype != x.dtype:
        residual = residual.to(x.dtype)  # the torch formula's first step, exact

    def run(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> object:
        return _rms_norm_cpu(a, w, eps, zero_centered, r)

    def ref(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> object:
        return _rms_norm_torch(a, w, eps, zero_centered=zero_centered, residual=r)

    return with_torch_backward(run, ref, x, weight, residual)  # type: ignore[return-value]


def _check_cpu(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Refuse what the kernel cannot run (never a silent fallback to another formula)."""
    codes = cpu_kernels.DTYPE_CODES
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and (t.dtype not in codes or t.device.type != "cpu"):
            raise ValueError(f"rms_norm: {name} is {t.dtype} on {t.device} (CPU: fp32/bf16/fp16)")
    d = x.shape[-1] if x.dim() else 0
    if d < 1 or weight.shape != (d,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} for x {tuple(x.shape)}")


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t, inner, outer, stride): row i of t's rows starts (i // inner) * outer + (i % inner)
    * stride elements in (`norm.cpp`'s `Rows`); a copy only where no such layout exists."""
    if t.stride(-1) == 1:
        if t.dim() == 2:
            return t, max(1, t.shape[0]), 0, t.stride(0)
        if t.dim() == 3:
            return t, max(1, t.shape[1]), t.stride(0), t.stride(1)
    t = t.contiguous()
    return t, max(1, t.numel() // t.shape[-1]), 0, t.shape[-1]


@cache
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("norm").isx_rms_norm_fwd
    i64, p, i32 = cpu_kernels.I64, cpu_kernels.PTR, ctypes.c_int
    fn.restype = ctypes.c_int
    fn.argtypes = [i64, i64, p, i64, i64, i64, p, i64, i64, i64, p, i32, p, p, i32,
                   ctypes.c_float, i32, i32]  # fmt: skip
    return fn


def _rms_norm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    rows = x.numel() // d
    xs, x_in, x_out, x_st = _rows(x)
    w = weight.contiguous()
    # the kernel writes rows one after another; the outputs keep `empty_like(x)`'s layout (an
    # elementwise torch op's, what the engine's compiled graph expects), copied into where a
    # dense permuted x gives another
    y = torch.empty_like(x)
    dense = y.is_contiguous()
    y_rows = y if dense else torch.empty(x.shape, dtype=x.dtype)
    res: tuple[torch.Tensor | None, int, int, int] = (None, 1, 0, 0)
    r_out = r_rows = None
    if residual is not None:
        res = _rows(residual)
        r_out = torch.empty_like(x)
        r_rows = r_out if dense else torch.empty(x.shape, dtype=x.dtype)
    codes, ptr = cpu_kernels.DTYPE_CODES, cpu_kernels.ptr
    rc = _kernel()(
        rows, d, ptr(xs), x_in, x_out, x_st, ptr(res[0]), res[1], res[2], res[3],
        ptr(w), codes[w.dtype], ptr(y_rows), ptr(r_rows), codes[x.dtype], float(eps),
        int(zero_centered), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"IsoExec's rms_norm CPU kernel refused its arguments (code {rc})")
    if not dense:
        y.copy_(y_rows)
        if r_out is not None:
            r_out.copy_(r_rows)
    return y if r_out is None else (y, r_out)


def _rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch formula: other devices' forward, and the CPU kernel's backward."""
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
