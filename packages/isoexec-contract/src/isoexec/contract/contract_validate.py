"""Contract validation: refuse, on building and on loading, a contract that could not be
compared honestly (unknown schema, malformed site names or hashes, impls inconsistent with
their op, a TP record that contradicts the parallel layout, a malformed speculation entry)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from isoexec.contract.contract_errors import ContractError, SchemaVersionError
from isoexec.contract.contract_types import (
    _HEX,
    _SITE_NAME,
    KNOWN_SCHEMA_VERSIONS,
    TP_INVARIANT,
    SiteRecord,
)
from isoexec.contract.impl import NATIVE_PREFIX, ImplInfo
from isoexec.contract.parallel_layout import ParallelLayout
from isoexec.contract.speculation import SpeculationError, check_speculation

if TYPE_CHECKING:
    from isoexec.contract.contract import Contract


def validate(c: Contract) -> None:
    """Refuse contracts that could not be compared honestly (applies to built and loaded)."""
    if type(c.schema_version) is not int or c.schema_version not in KNOWN_SCHEMA_VERSIONS:
        raise SchemaVersionError(f"unknown contract schema_version {c.schema_version!r}")
    checks: list[tuple[object, str, Callable[[object], bool]]] = [
        (c.model.architecture, "model.architecture", _nonempty),
        (c.model.config_digest, "model.config_digest", _nonempty),
        (c.dtypes.params, "dtypes.params", _nonempty),
        (c.dtypes.activations, "dtypes.activations", _nonempty),
        (c.dtypes.residual, "dtypes.residual", _nonempty),
        (c.dtypes.logprobs, "dtypes.logprobs", _nonempty),
        (c.device.torch, "device.torch", _nonempty),
        (c.device.device_kind, "device.device_kind", _nonempty),
        (c.device.arch, "device.arch", _nonempty),
    ]
    for value, where, ok in checks:
        if not ok(value):
            raise ContractError(f"{where}: must be a non-empty string, got {value!r}")
    if not isinstance(c.model.layer_kinds, tuple):
        raise ContractError("model.layer_kinds: must be a tuple of strings")
    if c.device.threads is not None and (type(c.device.threads) is not int or c.device.threads < 1):
        raise ContractError("device.threads: must be a positive integer or None")
    if not isinstance(c.device.patches, tuple) or not all(_nonempty(p) for p in c.device.patches):
        raise ContractError("device.patches: must be a tuple of non-empty strings")
    if not isinstance(c.parallel, ParallelLayout):
        raise ContractError(f"parallel: must be a ParallelLayout, got {c.parallel!r}")
    try:
        check_speculation(c.speculation)
    except SpeculationError as e:
        raise ContractError(str(e)) from None
    if not isinstance(c.sites, tuple) or not c.sites:
        raise ContractError("a contract needs at least one site (as a tuple of SiteRecord)")
    seen: set[str] = set()
    for s in c.sites:
        if not isinstance(s, SiteRecord) or not isinstance(s.impl, ImplInfo):
            raise ContractError(f"sites must be SiteRecord(name, ImplInfo, tp), got {s!r}")
        if not isinstance(s.name, str) or not _SITE_NAME.match(s.name):
            raise ContractError(f"invalid site name {s.name!r}")
        if s.name in seen:
            raise ContractError(f"duplicate site {s.name!r}")
        seen.add(s.name)
        i = s.impl
        if not _nonempty(i.op) or not _nonempty(i.impl_id) or not _nonempty(i.backend):
            raise ContractError(f"site {s.name!r}: op, impl_id and backend must be non-empty")
        if i.impl_id.startswith(NATIVE_PREFIX) and i.impl_id == NATIVE_PREFIX:
            raise ContractError(f"site {s.name!r}: native impl without a module class")
        if type(i.version) is not int or i.version < 0:
            raise ContractError(f"site {s.name!r}: version must be a non-negative integer")
        if not isinstance(i.source_fingerprint, str) or (
            i.source_fingerprint and not _HEX.match(i.source_fingerprint)
        ):
            raise ContractError(f"site {s.name!r}: source_fingerprint must be lower-case hex")
        if not i.is_native and not i.source_fingerprint:
            raise ContractError(
                f"site {s.name!r}: impl {i.impl_id!r} has no source fingerprint (an edited "
                "kernel could keep an old hash)"
            )
        keys = [k for k, _ in i.params]
        if keys != sorted(set(keys)) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in i.params
        ):
            raise ContractError(
                f"site {s.name!r}: params must be sorted unique (str, str) pairs "
                "(use ImplInfo.make)"
            )
        if not (s.tp == TP_INVARIANT or (s.tp.isdigit() and s.tp[0] != "0")):
            raise ContractError(f"site {s.name!r}: tp must be 'invariant' or a degree ≥ 1")


def _nonempty(v: object) -> bool:
    return isinstance(v, str) and v != ""
