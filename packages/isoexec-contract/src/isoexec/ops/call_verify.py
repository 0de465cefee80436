"""`ISOEXEC_VERIFY_CALLS=1`: check, while a model runs, that what ran at each site is what the
site records.

Why: the contract records what each site *installed*. Site bindings (`binding`) make record
and call one object, but an instance can still be tampered with after construction: its record
replaced, its `forward` swapped for a native kernel, a call made past its binding. This debug
mode watches the calls instead of trusting the construction.

How: with the switch on, every call through a site's `SiteOps` is noted, and process-wide
forward hooks (torch's global module hooks, installed only in this mode) keep a stack of the
sites whose `forward` is running: every module that records a canonical op (on itself, or
where the engine keeps its maths: `quant_method`, `impl`, `base_layer`). A call is refused
(`WrongCallError`) when

- its binding's record is no longer what its owner records (a record replaced), or
- it runs inside a site that records the same op with another implementation (a foreign call);

and a site whose `forward` ends is refused when an op it records ran no call at all (a native
kernel, or a direct call to `isoexec.ops`, in place of its binding). Only ops that run outside
their holder's forward, or not on every batch, are exempt (`NOT_EVERY_FORWARD`).

A holder whose op runs outside its module's forward is marked `isoexec_outside_forward`.
Compiled graphs run without Python, so the engine refuses this mode unless it runs eager.
Counts of verified calls (`verified_calls`) let a caller show that checking happened.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from isoexec.contract.impl import ImplInfo, declared_impl
from isoexec.contract.protocol import SiteRefusedError

VERIFY_CALLS_ENV = "ISOEXEC_VERIFY_CALLS"

# Recorded ops that legitimately run no call during their holder's forward: the logprobs op
# runs after the model (the trainer's scoring, the engine's sampler only when logprobs are
# asked for), a LoRA op only on batches that have adapter rows.
NOT_EVERY_FORWARD = frozenset({"logprobs", "lora"})
# Where the engine keeps a site's maths besides the module itself (as its read-back does).
_HOLDER_ATTRS = ("quant_method", "impl", "base_layer")


class WrongCallError(SiteRefusedError):
    """What ran at a site is not what the site records."""


def verify_calls_enabled() -> bool:
    """Whether `ISOEXEC_VERIFY_CALLS` is on ("1"); refused unless "", "0" or "1"."""
    value = os.environ.get(VERIFY_CALLS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{VERIFY_CALLS_ENV}={value!r}: use 1 (on) or 0 (off)")
    if value == "1":
        _ensure_hooks()
        return True
    return False


@dataclass
class _Frame:
    module: torch.nn.Module
    records: dict[str, ImplInfo]
    ran: set[str] = field(default_factory=set)


class _State(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []


_state = _State()
_verified: Counter[str] = Counter()
_hooks: list[Any] = []
_lock = threading.Lock()


def verified_calls() -> dict[str, int]:
    """Calls verified so far in this process, by `op:impl_id`."""
    return dict(_verified)


def reset_verified_calls() -> None:
    _verified.clear()


def site_label(module: object) -> str:
    """A module's name in errors: its class and, where the framework gives one, its prefix."""
    name = getattr(module, "layer_name", None) or getattr(module, "prefix", None)
    return f"{type(module).__name__}({name})" if name else type(module).__name__


def site_records(module: object) -> dict[str, ImplInfo]:
    """The canonical ops `module` records, by op: its own declarations and those of the
    objects where the engine keeps a site's maths (native records are not checked). A holder
    whose op the framework calls outside the module's forward says so with
    `isoexec_outside_forward = True` (vLLM's LM head method: its `apply` runs from the logits
    processor, not from the embedding's forward); its calls are checked against its record
    only."""
    found: dict[str, ImplInfo] = {}
    holders = [module, *(getattr(module, a, None) for a in _HOLDER_ATTRS)]
    base = getattr(module, "base_layer", None)
    if base is not None:
        holders.append(getattr(base, "quant_method", None))
    for holder in holders:
        if holder is None or getattr(holder, "isoexec_outside_forward", False):
            continue
        impls = getattr(holder, "isoexec_impls", None) or {}
        single = getattr(holder, "isoexec_impl", None)
        for impl in [*impls.values(), single]:
            if isinstance(impl, ImplInfo) and not impl.is_native:
                found.setdefault(impl.op, impl)
    return found


def note_call(binding: Any, name: str) -> None:
    """One call through a site binding (`binding.SiteOps`): check it against its owner's
    record and against the innermost running site that records its op."""
    impl: ImplInfo = binding.impl
    owner = binding.owner
    if owner is not None:
        record = declared_impl(owner, impl.op)
        if record != impl:
            raise WrongCallError(
                f"{site_label(owner)} records {_describe(record)} for {impl.op}, but its "
                f"binding ran {name} of {_describe(impl)}"
            )
    for frame in reversed(_state.frames):
        if impl.op in frame.records:
            if frame.records[impl.op] != impl:
                raise WrongCallError(
                    f"{site_label(frame.module)} records {_describe(frame.records[impl.op])} "
                    f"for {impl.op}, but a call of {name} from {_describe(impl)} ran in it"
                )
            frame.ran.add(impl.op)
            break
    _verified[f"{impl.op}:{impl.impl_id}"] += 1


def _describe(impl: ImplInfo | None) -> str:
    if impl is None:
        return "nothing"
    params = ",".join(f"{k}={v}" for k, v in impl.params)
    return f"{impl.impl_id}@{impl.version}[{impl.backend}]({params})"


def _pre(module: torch.nn.Module, args: Any) -> None:
    records = site_records(module)
    if records:
        _state.frames.append(_Frame(module, records))


def _post(module: torch.nn.Module, args: Any, output: Any) -> None:
    frames = _state.frames
    if not frames or not any(f.module is module for f in frames):
        return
    frame = frames.pop()
    while frame.module is not module:  # a nested forward that raised
        frame = frames.pop()
    missing = sorted(set(frame.records) - frame.ran - NOT_EVERY_FORWARD)
    if missing:
        what = ", ".join(f"{op} ({_describe(frame.records[op])})" for op in missing)
        raise WrongCallError(
            f"{site_label(module)} records {what} but no call of it ran during its forward: "
            "something else computed this site (a native kernel, or isoexec.ops called past "
            "the site's binding)"
        )


def _ensure_hooks() -> None:
    with _lock:
        if _hooks:
            return
        from torch.nn.modules import module as nn_module

        _hooks.append(nn_module.register_module_forward_pre_hook(_pre))
        _hooks.append(nn_module.register_module_forward_hook(_post, always_call=True))


def remove_hooks() -> None:
    """Remove the process-wide hooks (tests; a process in verify mode keeps them)."""
    with _lock:
        for h in _hooks:
            h.remove()
        _hooks.clear()
        _state.frames.clear()


__all__ = [
    "NOT_EVERY_FORWARD",
    "VERIFY_CALLS_ENV",
    "WrongCallError",
    "note_call",
    "remove_hooks",
    "reset_verified_calls",
    "site_label",
    "site_records",
    "verified_calls",
    "verify_calls_enabled",
]
