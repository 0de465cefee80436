"""Canonical rotary embedding: one table builder, one apply (neox rotate-half, partial).

Why: the stock kernels (vLLM's C++ rope, HF's bf16 maths) differ by an ulp on many
elements. The table is built in fp32 from a pinned inv_freq formula with position-invariant
cos/sin, and applied in fp32 with a single rounding. On CPU the apply is one compiled loop
(`cpu_kernels/rope.cpp`) doing the torch formula's operations in its order, so the same bits
(the formula, `_apply_rope_torch`, runs elsewhere and gives the kernel its backward);
`apply_rope_at` reads each token's table row by its position inside the kernel.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from . import _pointwise as pw
from . import cpu_kernels
from ._autograd import with_torch_backward

# The compiled CPU kernels this module runs (their sources are part of its ops' fingerprint).
KERNEL_LIBRARIES = ("rope",)


def rope_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """`1 / base^(2i/rotary_dim)` in fp32, exactly HF's formula (int64 arange -> fp32)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / pw.pointwise(lambda e: torch.pow(float(base), e), exponent)


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) tables [T, rotary_dim // 2] for integer positions [T].

    An entry depends only on its position (not on which other positions are in the table).
    """
    inv_freq = rope_inv_freq(rotary_dim, base).to(positions.device)
    freqs = positions.reshape(-1).float()[:, None] * inv_freq[None, :]
    return pw.cos(freqs), pw.sin(freqs)


# (rotary_dim, base, device) -> (cos, sin) for positions 0 .. n-1
_TABLES: dict[tuple[int, float, str], tuple[torch.Tensor, torch.Tensor]] = {}
_MIN_TABLE = 4096


def rope_cos_sin_table(
    positions: torch.Tensor, rotary_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin` by lookup in a table of positions 0..n-1, built once per (rotary_dim,
    base, device) and rebuilt twice as long when a position reaches past it.

    The same bits as `rope_cos_sin` (an entry depends only on its position, so the table's
    row p is what `rope_cos_sin` computes for p anywhere); an engine step then does two
    lookups per layer instead of recomputing the padded cos/sin of every position.
    """
    pos = positions.reshape(-1)
    table = _table(pos, rotary_dim, base)
    if table is None:
        return rope_cos_sin(pos, rotary_dim, base)
    idx = pos.long()
    return table[0][idx], table[1][idx]


def _table(
    pos: torch.Tensor, rotary_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cached (cos, sin) of positions 0..n-1 covering every position in `pos` (None for
    none, or a negative position: no table holds it)."""
    if pos.numel() == 0 or int(pos.min()) < 0:
        return None
    need = int(pos.max()) + 1
    key = (rotary_dim, float(base), str(pos.device))
    table = _TABLES.get(key)
    if table is None or table[0].shape[0] < need:
        n = max(_MIN_TABLE, 1 << (need - 1).bit_length())
        table = rope_cos_sin(torch.arange(n, device=pos.device), rotary_dim, base)
        _TABLES[key] = table
    return table


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None
) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of x [T, H, D] (neox rotate-half), pass the rest.

    `out1 = x1*c - x2*s`, `out2 = x2*c + x1*s` in fp32, rounded once to x's dtype.
    cos/sin are [T, rotary_dim // 2] from `rope_cos_sin`.
    """
    rot = x.shape[-1] if rotary_dim is None else rotary_dim
    if not _kernel_runs(x, cos, sin):
        return _apply_rope_torch(x, cos, sin, rot)

    def run(a: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _apply_cpu(a, c, s, None, rot)

    def ref(a: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _apply_rope_torch(a, c, s, rot)

    return with_torch_backward(run, ref, x, cos, sin)  # type: ignore[return-value]


def apply_rope_at(
    x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float
) -> torch.Tensor:
    """`apply_rope(x, *rope_cos_sin_table(positions, ...), rotary_dim)` without the lookup's
    copies: on CPU the kernel reads each token's row of the table by its position (an
    engine's path: no gradient). The same bits."""
    pos = positions.reshape(-1)
    table = _table(pos, rotary_dim, base)
    if table is None or not _kernel_runs(x, *table) or x.requires_grad:
        return apply_rope(x, *rope_cos_sin_table(pos, rotary_dim, base), rotary_dim)
    return _apply_cpu(x, *table, pos.long(), rotary_dim)


def _kernel_runs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 3
        and x.dtype in cpu_kernels.DTYPE_CODES
        and cos.dtype == sin.dtype == torch.float32
    )


@cache
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("rope").isx_rope_apply
    i64, p, i32 = cpu_kernels.I64, cpu_kernels.PTR, ctypes.c_int
    fn.restype = ctypes.c_int
    fn.argtypes = [i64, i64, i64, i64, p, i64, i64, p, p, p, p, i32, i32]
    return fn


def _apply_cpu(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    rot: int,
) -> torch.Tensor:
    """The kernel on x [T, H, D]: (cos, sin) per token [T, rot/2], or table rows picked by
    `positions` (int64 [T], each within the table)."""
    t, h, d = x.shape
    half = rot // 2
    if rot % 2 or not 2 <= rot <= d:
        raise ValueError(f"apply_rope: rotary_dim {rot} for head size {d}")
    cos, sin = cos.contiguous(), sin.contiguous()
    rows = t if positions is None else cos.shape[0]
    if cos.shape != (rows, half) or sin.shape != (rows, half):
        raise ValueError(f"apply_rope: cos/sin {tuple(cos.shape)} for {t} tokens, rot {rot}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    ptr = cpu_kernels.ptr
    rc = _kernel()(
        t, h, d, rot, ptr(x), x.stride(0), x.stride(1), ptr(cos), ptr(sin),
        ptr(positions), ptr(out), cpu_kernels.DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"IsoExec's RoPE CPU kernel refused its arguments (code {rc})")
    return out


def _apply_rope_torch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None
) -> torch.Tensor:
    """The torch formula: other devices' apply, and the CPU kernel's backward."""
    d = x.shape[-1]
    rot = d if rotary_dim is None else rotary_dim
    half = rot // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rot]
    c = cos.float().reshape(cos.shape[0], *([1] * (x.dim() - 2)), half)
    s = sin.float().reshape(sin.shape[0], *([1] * (x.dim() - 2)), half)
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if rot < d:
        parts.append(xf[..., rot:])
    return torch.cat(parts, dim=-1).to(x.dtype)
