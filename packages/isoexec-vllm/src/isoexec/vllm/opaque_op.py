"""`opaque_op`: register a Python function as a `torch.ops.isoexec.*` op that torch.compile
cannot see into, with as little dispatch between the compiled graph and the function as torch
allows.

Why not `torch.library.custom_op`: its op runs the function through an autograd wrapper, a
redispatch, a per-device table and a `torch.compiler.disable` frame, about 4 us a call on
these CPUs. A decode step at the bench's small size calls some 46 of them (#37's profile).
The engine never differentiates through its ops, so this registers the function directly as
the op's CPU and CUDA kernel, which is how vLLM registers its own ops
(`direct_register_custom_op`). The op's schema is inferred from the function's annotations and
its fake (shape-only) implementation is what the compiled graph traces instead of the body, as
with `custom_op`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

NAMESPACE = "isoexec"
DISPATCH_KEYS = ("CPU", "CUDA")  # the engine's devices; Meta/fake tracing uses the fake
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


class OpaqueOp:
    """A registered op: call it like the function; `register_fake` takes its shape rule."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"

    def __call__(self, *args: Any) -> Any:
        return getattr(torch.ops.isoexec, self.name)(*args)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def opaque_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[..., OpaqueOp]:
    """Decorator: define `isoexec::<name>` with the function's schema, the function as its
    kernel on every engine device. `mutates_args` names the arguments it writes in place."""

    def register(fn: Callable[..., Any]) -> OpaqueOp:
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIBRARY.define(name + schema)
        for key in DISPATCH_KEYS:
            _LIBRARY.impl(name, fn, key)
        return OpaqueOp(name)

    return register


__all__ = ["DISPATCH_KEYS", "NAMESPACE", "OpaqueOp", "opaque_op"]
