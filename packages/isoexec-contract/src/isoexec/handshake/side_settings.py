"""What a participant runs that its contract does not hash, offered beside the contract.

The contract hashes what changes bits; a setting that canonically changes none is declared
"invariant" there (an IsoExec engine's speculation, `isoexec.contract.speculation`; its TP
degree, `parallel_layout`), so two engines that speculate differently still MATCH their
trainer. What they actually run is still worth knowing when a run is audited, so each
participant offers it as settings (`OfferRequest.settings`), and every verdict reports each
participant's (`ParticipantHash.settings`). They are never compared and never decide a
verdict: the hash does.

Strict all the same, like everything a peer sends: at most 16 entries, keys of [a-z0-9_]
(1-40 chars, starting with a letter), values of printable ASCII up to 128 chars.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_ENTRIES = 16
MAX_VALUE_CHARS = 128
_KEY = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_VALUE = re.compile(r"^[\x20-\x7e]*$")

Settings = tuple[tuple[str, str], ...]


class SideSettingsError(ValueError):
    """Settings that break the rules of the module doc."""


def check_settings(raw: Mapping[str, str] | None) -> Settings:
    """The settings as sorted (key, value) pairs, or SideSettingsError naming the fault."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise SideSettingsError(f"settings must be a mapping, got {type(raw).__name__}")
    if len(raw) > MAX_ENTRIES:
        raise SideSettingsError(f"settings: {len(raw)} entries, at most {MAX_ENTRIES}")
    for key, value in raw.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise SideSettingsError(
                f"settings key {key!r}: 1-40 chars of [a-z0-9_], starting with a letter"
            )
        if not isinstance(value, str) or len(value) > MAX_VALUE_CHARS or not _VALUE.match(value):
            raise SideSettingsError(
                f"settings[{key!r}]: a string of printable ASCII, at most {MAX_VALUE_CHARS} "
                f"chars, got {value!r}"
            )
    return tuple(sorted(raw.items()))


def format_settings(settings: Settings) -> str:
    """`key=value key=value`, for logs and the CLI; empty when there are none."""
    return " ".join(f"{k}={v}" for k, v in settings)


__all__ = [
    "MAX_ENTRIES",
    "MAX_VALUE_CHARS",
    "Settings",
    "SideSettingsError",
    "check_settings",
    "format_settings",
]
