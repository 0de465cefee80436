"""When the canonical ops go through their autograd Functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def grad_wanted(*inputs: torch.Tensor | None) -> bool:
    """Grad mode is on and an input needs a gradient. Where not (an engine step), an op calls
    its forward directly: the same kernel and bits, without the Function's bookkeeping."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


class _TorchBackward(torch.autograd.Function):
    """Forward: a kernel (Triton, or a compiled CPU one). Backward: autograd through the
    torch formula of the same op, recomputed."""

    @staticmethod
    def forward(ctx, run: Callable[..., object], ref: Callable[..., object], *tensors):  # type: ignore[override]
        ctx.ref = ref
        ctx.save_for_backward(*tensors)
        out = run(*tensors)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.is_tuple = isinstance(out, tuple)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        saved = ctx.saved_tensors
        ins = [
            None if t is None else t.detach().requires_grad_(bool(ctx.needs_input_grad[2 + i]))
            for i, t in enumerate(saved)
        ]
        with torch.enable_grad():
            out = ctx.ref(*ins)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad
        ]
        wanted = [t for t in ins if t is not None and t.requires_grad]
        got: Sequence[torch.Tensor | None] = ()
        if pairs and wanted:
            got = torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
        it = iter(got)
        res = [next(it, None) if t is not None and t.requires_grad else None for t in ins]
        return (None, None, *res)


def with_torch_backward(
    run: Callable[..., object], ref: Callable[..., object], *tensors: torch.Tensor | None
) -> object:
    """`run(*tensors)` (a kernel), differentiable through `ref(*tensors)` (the torch formula).

    Why: only forward logprobs must be bitwise; gradients need to be correct. The backward
    recomputes the op as torch ops under autograd and back-propagates through them, so a
    kernel needs no hand-written backward."""
    needs = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if not needs:
        return run(*tensors)
    return _TorchBackward.apply(run, ref, *tensors)
