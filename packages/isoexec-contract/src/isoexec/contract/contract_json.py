"""Canonical JSON for contracts: one byte string per value (sorted keys, no floats, no
duplicate keys, no NaN), and the strict readers `Contract.from_dict` uses on untrusted input."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from isoexec.contract.contract_errors import ContractError


def canonical_json(obj: object) -> bytes:
    """Sorted keys, no whitespace, UTF-8; refuses floats (anywhere) and non-string keys."""
    _check_no_floats(obj, "$")
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _check_no_floats(obj: object, where: str) -> None:
    if isinstance(obj, float):
        raise ContractError(f"{where}: floats are not allowed in a contract (use exact strings)")
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ContractError(f"{where}: non-string key {k!r}")
            _check_no_floats(v, f"{where}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_no_floats(v, f"{where}[{i}]")
    elif not (obj is None or isinstance(obj, str | int)):
        raise ContractError(f"{where}: {type(obj).__name__} is not a JSON contract value")


def _exactify(obj: object) -> object:
    if isinstance(obj, bool) or obj is None or isinstance(obj, int | str):
        return obj
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        return obj.hex()
    if isinstance(obj, Mapping):
        return {str(k): _exactify(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_exactify(v) for v in obj]
    return str(obj)


def _refuse_float(s: str) -> Any:
    raise ContractError(f"float {s} in contract: floats are not allowed (use exact strings)")


def _refuse_constant(s: str) -> Any:
    raise ContractError(f"{s} in contract: not allowed")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ContractError(f"duplicate key {k!r} in contract")
        out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _obj(v: object, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ContractError(f"{where}: expected an object")
    return v


def _exact_keys(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ContractError(f"{where}: unknown field(s) {', '.join(unknown)}")
    missing = sorted(allowed - set(d))
    if missing:
        raise ContractError(f"{where}: missing field(s) {', '.join(missing)}")


def _str(v: object, where: str) -> str:
    if not isinstance(v, str):
        raise ContractError(f"{where}: expected a string, got {type(v).__name__}")
    return v


def _opt_str(v: object, where: str) -> str | None:
    return None if v is None else _str(v, where)


def _str_list(v: object, where: str) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise ContractError(f"{where}: expected a list of strings")
    return tuple(_str(x, f"{where}[]") for x in v)
