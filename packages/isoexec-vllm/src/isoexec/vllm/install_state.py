"""Whether IsoExec is installed in this vLLM process: its own module so that what reads it
(`engine_contract`) does not import the composition root (`install`), which imports it."""

from __future__ import annotations

_INSTALLED = False


def mark_installed() -> None:
    global _INSTALLED
    _INSTALLED = True


def is_installed() -> bool:
    return _INSTALLED
