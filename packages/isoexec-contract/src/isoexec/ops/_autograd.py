"""When the canonical ops go through their autograd Functions."""

from __future__ import annotations

import torch


def grad_wanted(*inputs: torch.Tensor | None) -> bool:
    """Grad mode is on and an input needs a gradient. Where not (an engine step), an op calls
    its forward directly: the same kernel and bits, without the Function's bookkeeping."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
