"""Plumbing shared by the Triton kernels: where they may run, and their backward passes.

Why a torch backward: only forward logprobs must be bitwise; gradients need to be correct.
The backward of every Triton op recomputes the torch canonical op under autograd and
back-propagates through it, so each kernel needs no hand-written backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from .._autograd import with_torch_backward as with_torch_backward  # the kernels' backward


def interpreting() -> bool:
    """True when Triton runs kernels on CPU (TRITON_INTERPRET=1 set before importing triton)."""
    return bool(knobs.runtime.interpret)


def _install_blas_free_interpreter_dot() -> None:
    """Under the interpreter, `tl.dot` on floats without the machine's BLAS.

    Triton's interpreter computes `tl.dot` with `np.matmul`, i.e. the BLAS numpy links, and a
    BLAS may give a row of a fixed-shape GEMM other bits at another row position: OpenBLAS's
    Haswell sgemm does (measured; this machine kind forces `OPENBLAS_CORETYPE=Haswell` on AMD
    EPYC). The interpreter would then show a dependence on the tile position that belongs to
    numpy's BLAS, not to the kernel. `np.einsum` without optimisation runs numpy's own loop,
    the same for every output element, so what the interpreter shows is the kernel's structure
    on any CPU. (The interpreter's bits never stand for a GPU's anyway.)
    """
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    stock = InterpreterBuilder.create_dot
    if getattr(stock, "_isoexec_blas_free", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return stock(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        prod = np.einsum("...mk,...kn->...mn", a.data.astype(acc), b.data.astype(acc))
        return TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._isoexec_blas_free = True  # type: ignore[attr-defined]
    InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]


def check_device(t: torch.Tensor) -> None:
    """CPU tensors only work under the interpreter; say so instead of a cryptic launch error."""
    if t.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "isoexec Triton kernels got CPU tensors but Triton is not in interpreter mode: "
            "set TRITON_INTERPRET=1 before triton is first imported, or use CUDA tensors"
        )


def pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(1, int(n))))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact IEEE fp32 products. bf16/fp16 inputs are upcast to fp32 in the
    kernel; their mantissas fit TF32's 10 bits, so a TF32 MMA multiplies them exactly."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _to_bf16_rne(x):
    # Triton's interpreter truncates fp32 -> bf16 (and ignores `fp_downcast_rounding`); the
    # GPU rounds to nearest-even. Integer maths gives torch's rounding on both.
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)  # NaN stays a (quiet) NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def rounded_like(x, ptrs):
    """fp32 `x` rounded once, to nearest-even, to the pointers' dtype (as an fp32 value)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        return _to_bf16_rne(x).to(tl.float32)
    else:
        return x.to(ptrs.dtype.element_ty).to(tl.float32)


@triton.jit
def store_rounded(ptrs, x, mask):
    """Store fp32 `x` rounded once, to nearest-even, to the pointers' dtype."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, _to_bf16_rne(x), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


if interpreting():
    _install_blas_free_interpreter_dot()
