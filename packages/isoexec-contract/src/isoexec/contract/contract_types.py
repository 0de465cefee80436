"""The contract's value types and constants (identity, dtypes, backend, site records), apart
from the `Contract` itself, so that the modules the contract uses (`backend`, `contract_validate`)
depend on these and not on it: no import cycle."""

from __future__ import annotations

import re
from dataclasses import dataclass

from isoexec.contract.impl import ImplInfo

SCHEMA_VERSION = 5  # 3: the patches; 4: "backend" renamed "device"; 5: "speculation"
KNOWN_SCHEMA_VERSIONS = frozenset({SCHEMA_VERSION})
TP_INVARIANT = "invariant"

_SITE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-/\[\]]*$")
_HEX = re.compile(r"^[0-9a-f]+$")


# --------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelIdentity:
    """Which model: architecture, a digest of the numerics-relevant config, layer kinds.

    `config_digest` should come from `config_digest(...)` over the config fields that change
    bits (hidden size, eps, rope theta, head counts, …), not the whole config (paths, names).
    """

    architecture: str
    config_digest: str
    layer_kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Dtypes:
    """Dtypes that change bits. `None` means "not applicable" (e.g. no recurrent state)."""

    params: str
    activations: str
    residual: str
    kv_cache: str | None
    recurrent_state: str | None
    logprobs: str


@dataclass(frozen=True)
class DeviceIdentity:
    """The software/hardware under the ops: a CPU ISA or GPU arch changes kernels and bits.

    `threads` is recorded only where a backend depends on it (canonical ops do not), else None.
    `triton` only when a Triton kernel is installed, `cuda` only on CUDA devices.
    `patches`: every write IsoExec makes into either framework, as declared by the IsoExec
    that built the contract (`patch_table.contract_patch_list`: `side:name@version`), so a
    peer whose IsoExec patches differently is named in the diff.
    """

    torch: str
    device_kind: str
    arch: str
    triton: str | None = None
    cuda: str | None = None
    threads: int | None = None
    patches: tuple[str, ...] = ()


@dataclass(frozen=True)
class SiteRecord:
    """One place in the model where an op runs, and the impl actually installed there."""

    name: str
    impl: ImplInfo
    tp: str = "1"  # "invariant" or the TP degree the site ran at

    @property
    def tp_invariant(self) -> bool:
        return self.tp == TP_INVARIANT


def site_sort_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Numeric-aware order of site names (`layers.2` before `layers.10`); the order of loaded
    contracts and of diffs when no model order is known."""
    parts: list[tuple[int, int | str]] = []
    for piece in re.split(r"(\d+)", name):
        if piece == "":
            continue
        parts.append((0, int(piece)) if piece.isdigit() else (1, piece))
    return tuple(parts)


__all__ = [
    "KNOWN_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "TP_INVARIANT",
    "DeviceIdentity",
    "Dtypes",
    "ModelIdentity",
    "SiteRecord",
    "site_sort_key",
]
