"""What an implementation of an op *is*, as the contract records it.

`ImplInfo` is the meeting point of the canonical ops (which describe themselves with it)
and the contract (which records, per site, the `ImplInfo` actually installed there).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

NATIVE_PREFIX = "native:"


def source_fingerprint(*objs: Callable[..., object] | type | ModuleType) -> str:
    """SHA-256 (hex, first 16 bytes) of the source code of the given functions/classes/modules.

    An edited kernel gets a new fingerprint even if nobody bumps its version, so it can never
    keep an old contract hash.
    """
    h = hashlib.sha256()
    for obj in objs:
        src = inspect.getsource(obj)
        h.update(src.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:32]


def code_closure(
    *objs: Callable[..., object] | type | ModuleType, package: str
) -> list[ModuleType]:
    """Every module of `package` whose code the given functions/classes/modules may execute:
    their own modules and, transitively, the package's modules they reference (imported as
    modules, or through a function/class imported from them), sorted by name.

    An implementation's fingerprint covers this closure, so editing any helper it calls, in
    any module, changes its hash (a hand-kept list of functions misses helpers).
    """
    import sys

    def in_package(mod: ModuleType | None) -> bool:
        return mod is not None and (
            mod.__name__ == package or mod.__name__.startswith(package + ".")
        )

    seen: dict[str, ModuleType] = {}
    stack = [o if isinstance(o, ModuleType) else sys.modules[o.__module__] for o in objs]
    while stack:
        mod = stack.pop()
        if mod.__name__ in seen or not in_package(mod):
            continue
        seen[mod.__name__] = mod
        for value in vars(mod).values():
            if isinstance(value, ModuleType):
                dep: ModuleType | None = value
            else:
                dep = sys.modules.get(getattr(value, "__module__", None) or "")
            if dep is not None and in_package(dep) and dep.__name__ not in seen:
                stack.append(dep)
    return [seen[name] for name in sorted(seen)]


@dataclass(frozen=True)
class ImplInfo:
    """One implementation of an op: id, version, backend, parameters and a source fingerprint.

    `params` values are strings (the contract holds no floats); use `ImplInfo.make` to build
    one from a plain mapping.
    """

    op: str
    impl_id: str
    version: int
    backend: str
    params: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    source_fingerprint: str = ""

    @staticmethod
    def make(
        op: str,
        impl_id: str,
        version: int,
        backend: str,
        params: Mapping[str, object] | None = None,
        source_fingerprint: str = "",
    ) -> ImplInfo:
        items = tuple(sorted((str(k), _param_str(v)) for k, v in (params or {}).items()))
        return ImplInfo(op, impl_id, version, backend, items, source_fingerprint)

    @staticmethod
    def native(op: str, module_class: str) -> ImplInfo:
        """A site left to the framework's own kernel: recorded, never omitted."""
        return ImplInfo(op, f"{NATIVE_PREFIX}{module_class}", 0, "native")

    @property
    def is_native(self) -> bool:
        return self.impl_id.startswith(NATIVE_PREFIX)

    def param_dict(self) -> dict[str, str]:
        return dict(self.params)


def declared_impl(holder: object, op: str) -> ImplInfo | None:
    """The `ImplInfo` an object declares for `op`, or None.

    The one convention both readbacks use: a module running several ops carries
    `isoexec_impls` ({op: ImplInfo}); a module running one carries `isoexec_impl`.
    """
    impls = getattr(holder, "isoexec_impls", None)
    if impls and op in impls:
        return impls[op]  # type: ignore[no-any-return]
    impl = getattr(holder, "isoexec_impl", None)
    if isinstance(impl, ImplInfo) and impl.op == op:
        return impl
    return None


def installed_impl(op: str, *holders: object, native_class: str) -> ImplInfo:
    """What runs `op` at a site: the first declaration found on `holders` (in order; None
    entries skipped), else the framework's own kernel, recorded as `native:<native_class>`.

    Each side passes the objects where its framework keeps the maths (the engine: the layer,
    its `quant_method` and its `impl`; the trainer: the module).
    """
    for holder in holders:
        if holder is not None and (found := declared_impl(holder, op)) is not None:
            return found
    return ImplInfo.native(op, native_class)


def _param_str(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return v.hex()  # exact, and never a JSON float
    return str(v)
