"""Canonical rotary embedding: one table builder, one apply (neox rotate-half, partial).

Why: the stock kernels (vLLM's C++ rope, HF's bf16 maths) differ by an ulp on many
elements. The table is built in fp32 from a pinned inv_freq formula with position-invariant
cos/sin, and applied in fp32 with a single rounding.
"""

from __future__ import annotations

import torch

from . import _pointwise as pw


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
    if pos.numel() == 0 or int(pos.min()) < 0:
        return rope_cos_sin(pos, rotary_dim, base)
    need = int(pos.max()) + 1
    key = (rotary_dim, float(base), str(pos.device))
    table = _TABLES.get(key)
    if table is None or table[0].shape[0] < need:
        n = max(_MIN_TABLE, 1 << (need - 1).bit_length())
        table = rope_cos_sin(torch.arange(n, device=pos.device), rotary_dim, base)
        _TABLES[key] = table
    idx = pos.long()
    return table[0][idx], table[1][idx]


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None
) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of x [T, H, D] (neox rotate-half), pass the rest.

    `out1 = x1*c - x2*s`, `out2 = x2*c + x1*s` in fp32, rounded once to x's dtype.
    cos/sin are [T, rotary_dim // 2] from `rope_cos_sin`.
    """
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
