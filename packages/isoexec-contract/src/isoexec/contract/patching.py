"""One mechanism for every write IsoExec makes into vLLM or Megatron-core: a patch registry.

A framework offers extension points (vLLM's `CustomOp`, `ModelRegistry`, Megatron's
`ModuleSpec`); where it offers none, IsoExec writes into it. Each such write belongs to one
declared patch (`patch_table.DECLARED`: target, reason, the framework version it was checked
against) and is made only inside `PatchRegistry.apply(name, ...)`, through `set_attr`,
`set_item` or `set_env`. Those record the value they replaced, so `undo(name)` puts the
framework back exactly as it was (an attribute or key that did not exist is removed again).
A write outside an applying patch, or under a name nobody declared, is refused.

Why one mechanism: a patch that can be listed, undone and checked against its table cannot
drift from what the docs and the contract say is patched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


class PatchError(RuntimeError):
    """A patch that cannot be applied as declared (undeclared, target gone, write outside)."""


@dataclass(frozen=True)
class PatchEntry:
    """One declared write into a framework: which side makes it, its name, the target(s) it
    writes, why no extension point serves, and the framework version it was checked against."""

    side: str  # "engine" (vLLM) or "trainer" (Megatron-core)
    name: str
    target: str
    reason: str
    checked_against: str

    @property
    def key(self) -> str:
        """`side:name@version`, how the contract lists it."""
        return f"{self.side}:{self.name}@{self.checked_against}"


@dataclass
class _Applied:
    undo: list[Callable[[], None]] = field(default_factory=list)


class PatchRegistry:
    """The patches one side has applied in this process, each with its undo."""

    def __init__(self, side: str, declared: tuple[PatchEntry, ...]) -> None:
        self.side = side
        self.declared = {e.name: e for e in declared if e.side == side}
        self._applied: dict[str, _Applied] = {}
        self._current: _Applied | None = None

    def apply(self, name: str, write: Callable[[], None], *, rerun: bool = False) -> None:
        """Run `write` (which writes only through `set_attr`/`set_item`/`set_env` of this
        registry) as the patch `name`. Idempotent unless `rerun` (a patch that must see
        modules imported since its last run); refused for an undeclared name."""
        if name not in self.declared:
            raise PatchError(
                f"{self.side} patch {name!r} is not declared in isoexec.contract.patch_table "
                f"(declared: {sorted(self.declared)})"
            )
        if name in self._applied and not rerun:
            return
        record = self._applied.get(name) or _Applied()
        self._current = record
        try:
            write()
        except BaseException:
            self._current = None
            if name not in self._applied:
                _undo(record)  # a half-applied patch leaves nothing behind
            raise
        self._current = None
        self._applied[name] = record

    def undo(self, name: str) -> None:
        """Put back everything patch `name` replaced (no-op if it is not applied)."""
        record = self._applied.pop(name, None)
        if record is not None:
            _undo(record)

    def undo_all(self) -> None:
        for name in reversed(list(self._applied)):
            self.undo(name)

    def applied(self) -> list[str]:
        """The names of the patches in force, in application order."""
        return list(self._applied)

    def is_applied(self, name: str) -> bool:
        return name in self._applied

    def _record(self) -> _Applied:
        if self._current is None:
            raise PatchError(
                f"a write into the framework outside {self.side} PatchRegistry.apply(): every "
                "write belongs to a declared patch"
            )
        return self._current

    def set_attr(self, owner: Any, attr: str, value: Any, *, must_exist: bool = True) -> None:
        """`setattr(owner, attr, value)`, undone by restoring the old value (or deleting it)."""
        record = self._record()
        old = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        if must_exist and not hasattr(owner, attr):
            raise PatchError(
                f"{getattr(owner, '__name__', type(owner).__name__)}.{attr} is gone: the "
                f"framework differs from the one this {self.side} patch was written for"
            )
        setattr(owner, attr, value)

        def undo() -> None:
            if old is _MISSING:
                if attr in getattr(owner, "__dict__", {}):
                    delattr(owner, attr)
            else:
                setattr(owner, attr, old)

        record.undo.append(undo)

    def set_item(self, mapping: MutableMapping[Any, Any], key: Any, value: Any) -> None:
        """`mapping[key] = value`, undone by restoring the old value (or removing the key)."""
        record = self._record()
        old = mapping.get(key, _MISSING)
        mapping[key] = value

        def undo() -> None:
            if old is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        record.undo.append(undo)

    def set_env(self, name: str, value: str, *, keep_user_value: bool = True) -> None:
        """`os.environ[name] = value` (left alone when the user set it and `keep_user_value`),
        undone by restoring the old value or unsetting it."""
        self._record()
        if keep_user_value and name in os.environ:
            return
        self.set_item(os.environ, name, value)


def _undo(record: _Applied) -> None:
    while record.undo:
        record.undo.pop()()


__all__ = ["PatchEntry", "PatchError", "PatchRegistry"]
