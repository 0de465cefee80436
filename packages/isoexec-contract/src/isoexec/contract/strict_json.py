"""Strict JSON for the reports IsoExec writes (`bench.json`, `results.json`).

Python's `json` writes a non-finite float as `NaN` / `Infinity`, which is not JSON: strict
readers (jq, JavaScript, many dashboards) reject the whole file. A report's missing
statistic (no tokens, no trainer run) is written as `null` instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float (nested in mappings and sequences) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(doc: Any) -> str:
    """Indented strict JSON of `doc` (non-finite floats as null), newline-terminated."""
    return json.dumps(finite(doc), indent=2, allow_nan=False) + "\n"
