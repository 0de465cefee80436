"""Canonical SiLU-and-multiply: `silu(gate) * up` for x = cat(gate, up) on the last dim.

Why: torch's CPU silu takes a scalar libm path for tail elements, so a value's bits depend
on its position; here silu is position-invariant (`pointwise`), all in fp32, one rounding.
"""

from __future__ import annotations

import torch

from . import _pointwise as pw


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], in fp32, rounded once to x's dtype."""
    i = x.shape[-1] // 2
    xf = x.float()
    return (pw.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


def attn_output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`out * sigmoid(gate)` in the model dtype (as HF Qwen3-Next), sigmoid position-invariant.

    Qwen3-Next's gated attention output; both sides call this one function.
    """
    return out * pw.sigmoid(gate)
