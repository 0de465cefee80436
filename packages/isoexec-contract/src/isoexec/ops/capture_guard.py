"""A mode in which an op that reads device data back to the host raises.

Why: on CUDA vLLM captures the model's forward in CUDA graphs, and an op inside a captured
piece must not sync with the host: `.item()`, `.tolist()`, `.cpu()`, `bool(t)`, and ops
whose output shape depends on the data (`nonzero`, `unique`, boolean masks, ...). Capture
refuses the sync, and a replay would skip whatever Python did with the value. CPU runs
capture no graphs, so such a sync passes every CPU test unseen. `HostSyncGuard` makes each
of them raise `HostSyncError` on any device, so a CPU test can show that an op is
graph-safe by construction (the Triton kernels run under the interpreter there).

What stands in for the GPU is not the op: a host read made by Triton's interpreter itself
(it copies tensors to numpy to run a kernel on the CPU) is allowed.

`ISOEXEC_CAPTURE_GUARD=1` makes the engine run each op it lets vLLM capture under the guard
(`isoexec.vllm.compiled_ops`); the ops vLLM runs between graphs (its splitting ops) are not
guarded, because they may read their step's metadata.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CAPTURE_GUARD_ENV = "ISOEXEC_CAPTURE_GUARD"

# Tensor methods that hand device data to Python.
SYNCING_METHODS = frozenset(
    {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
)
# aten ops that read a value back, or whose output shape depends on the data.
SYNCING_ATEN = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "bincount",
        "masked_select",
        "histc",
    }
)

T = TypeVar("T")


class HostSyncError(RuntimeError):
    """An op read device data on the host where vLLM may capture it in a CUDA graph."""


def capture_guard_enabled() -> bool:
    """Whether `ISOEXEC_CAPTURE_GUARD` asks for the guard ("1"); "", "0" or unset: no."""
    value = os.environ.get(CAPTURE_GUARD_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{CAPTURE_GUARD_ENV}={value!r}: use 1 (guard) or 0 / unset (off)")
    return value == "1"


def _in_triton_interpreter() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "triton" in frame.f_code.co_filename and "interpreter" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _refuse(what: str) -> None:
    if not _in_triton_interpreter():
        raise HostSyncError(
            f"{what} inside an op vLLM may capture in a CUDA graph: it reads device data on "
            "the host (capture refuses it, a replay would skip it)"
        )


def _aten_name(func: Any) -> str:
    return str(getattr(func, "__name__", func)).split(".")[0]


class _Methods(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCING_METHODS:
            _refuse(f"Tensor.{name}()")
        return func(*args, **(kwargs or {}))


class _Aten(TorchDispatchMode):
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = _aten_name(func)
        if name in SYNCING_ATEN:
            _refuse(f"aten.{name}")
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None:
            _refuse("aten.repeat_interleave without output_size")
        if name in ("index", "index_put", "index_put_") and _has_bool_index(args):
            _refuse(f"aten.{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncGuard:
    """Context in which host syncs raise `HostSyncError` (see the module docstring)."""

    def __init__(self) -> None:
        self._modes: list[Any] = []

    def __enter__(self) -> HostSyncGuard:
        self._modes = [_Methods(), _Aten()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(exc_type, exc, tb)
        self._modes = []


def run_guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, under the guard when `ISOEXEC_CAPTURE_GUARD=1`."""
    if not capture_guard_enabled():
        return fn(*args, **kwargs)
    with HostSyncGuard():
        return fn(*args, **kwargs)


__all__ = [
    "CAPTURE_GUARD_ENV",
    "HostSyncError",
    "HostSyncGuard",
    "capture_guard_enabled",
    "run_guarded",
]
