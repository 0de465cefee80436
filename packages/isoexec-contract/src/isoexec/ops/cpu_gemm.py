"""The canonical CPU GEMM's Python side: pack a weight into panels, call the kernel.

The bits are `cpu_kernels/gemm.cpp`'s: every output is one fp32 fused multiply-add chain over
k in ascending order, rounded once, so a row's bits never depend on the other rows, the
thread count or the machine's BLAS (docs/ops.md, "linear"). This module only moves data:
`pack_panels` lays the weight out for the kernel (done once per weight by the caller's
cache), `panel_gemm` checks the operands and calls it with as little Python as a decode
step can afford (the per-call cost was #37's largest row).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from . import cpu_kernels

KERNEL_LIBRARIES = ("gemm",)
PANEL = 32  # columns per packed panel (the kernel's NB)
DTYPES = frozenset(cpu_kernels.DTYPE_CODES)


@cache
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("gemm").isx_gemm
    i64, p = cpu_kernels.I64, cpu_kernels.PTR
    fn.restype = ctypes.c_int
    fn.argtypes = [p, i64, i64, i64, i64, p, p, ctypes.c_int, ctypes.c_int]
    return fn


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N/32), K, 32]: panel p holds columns 32p..32p+31 of the output,
    k-major, zero past N. In bf16 the 32 columns of one k are stored as pairs (j, j + 16), so
    the kernel widens a 32-bit word into both with a shift and a mask. Layout only: every
    packing gives the same bits."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    packed = padded.view(panels, PANEL, k).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        packed = packed.reshape(panels, k, 2, PANEL // 2).transpose(2, 3)
    return packed.contiguous().view(panels, k, PANEL)


def panel_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """y [M, n] = x [M, K] @ W^T for W packed by `pack_panels` (same dtype as x, on CPU).

    x's rows may lie any stride apart (a K-leaf's column slice); each row must be contiguous.
    """
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    m, k = x.shape
    if packed.shape[1] != k or packed.dtype != x.dtype:
        raise ValueError(
            f"cpu gemm: x {tuple(x.shape)} {x.dtype} against packed weight "
            f"{tuple(packed.shape)} {packed.dtype}"
        )
    y = torch.empty(m, n, dtype=x.dtype)
    ldx = x.stride(0) if m > 1 else k
    rc = _kernel()(
        x.data_ptr(), m, k, n, ldx, packed.data_ptr(), y.data_ptr(),
        cpu_kernels.DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"IsoExec's CPU GEMM kernel refused its arguments (code {rc})")
    return y


__all__ = ["DTYPES", "KERNEL_LIBRARIES", "PANEL", "pack_panels", "panel_gemm"]
