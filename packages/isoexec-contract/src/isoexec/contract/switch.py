"""The one switch: `ISOEXEC=1` turns IsoExec on; anything else leaves both frameworks stock."""

from __future__ import annotations

import os

ENV_VAR = "ISOEXEC"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def isoexec_enabled() -> bool:
    """Read the switch. An unrecognised value is an error, never a silent 'off'."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: expected 1/0 (or true/false, on/off)")
