"""The canonical CPU GEMM's Python side: pack a weight into panels, call the kernel.

The bits are `cpu_kernels/gemm.cpp`'s: every output is one fp32 fused multiply-add chain over
k in ascending order (bf16: in k pairs, VDPBF16PS's order), rounded once, so a row's bits
never depend on the other rows, the thread count or the machine's BLAS (docs/ops.md,
"linear"). This module only moves data:
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
    fn.argtypes = [p, i64, i64, i64, i64, p, p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N/32), K, 32]: panel p holds columns 32p..32p+31 of the output,
    k-major, zero past N. In bf16 the kernel takes k in pairs, so a panel is [K/2, 32, 2]
    (K padded to even with zeros): column j's two weights of one pair in one 32-bit word.
    Layout only: the bits are the kernel's order, not the packing's."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    pairs = weight.dtype == torch.bfloat16
    kp = k + (k % 2 if pairs else 0)
    padded = weight.new_zeros(panels * PANEL, kp)
    padded[:n, :k] = weight
    if pairs:
        return padded.view(panels, PANEL, kp // 2, 2).transpose(1, 2).contiguous()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def panel_gemm(
    x: torch.Tensor, packed: torch.Tensor, n: int, *, fp32_out: bool = False
) -> torch.Tensor:
    """y [M, n] = x [M, K] @ W^T for W packed by `pack_panels` (same dtype as x, on CPU).

    x's rows may lie any stride apart (a K-leaf's column slice); each row must be contiguous.
    `fp32_out`: the fp32 chains before the final rounding (what the tests check the order on:
    a bf16 rounding hides it).
    """
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    m, k = x.shape
    k_packed = (k + 1) // 2 if x.dtype == torch.bfloat16 else k
    if packed.shape[1] != k_packed or packed.dtype != x.dtype or packed.shape[0] * PANEL < n:
        raise ValueError(
            f"cpu gemm: x {tuple(x.shape)} {x.dtype} against packed weight "
            f"{tuple(packed.shape)} {packed.dtype}"
        )
    y = torch.empty(m, n, dtype=torch.float32 if fp32_out else x.dtype)
    ldx = x.stride(0) if m > 1 else k
    rc = _kernel()(
        x.data_ptr(), m, k, n, ldx, packed.data_ptr(), y.data_ptr(),
        cpu_kernels.DTYPE_CODES[x.dtype], int(fp32_out), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"IsoExec's CPU GEMM kernel refused its arguments (code {rc})")
    return y


__all__ = ["DTYPES", "KERNEL_LIBRARIES", "PANEL", "pack_panels", "panel_gemm"]
