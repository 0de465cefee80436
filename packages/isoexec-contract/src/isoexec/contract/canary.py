"""The numeric canary: one fixed probe sequence, scored by both sides under their live weights
and settings, compared bit for bit.

A contract describes what each side installed; a canary checks what each side computes. It
catches what the contract failed to describe — a setting nobody audited, a patched kernel
that kept its version, weights that differ — at the cost of one short forward per side. The
probe is derived from the run id (both sides make the same one without talking), its
logprobs are the T=1 logprobs of tokens 1..n-1 (a prompt-logprobs request on the engine, run in
a batch with other requests; `score` on the trainer), and the handshake service compares them
(`handshake.canary`). Framework-free.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

PROBE_TOKENS = 64
MAX_VALUES = 4096  # a canary carries at most this many logprobs


class CanaryError(ValueError):
    """Malformed canary values."""


def canary_probe(run_id: str, vocab_size: int, length: int = PROBE_TOKENS) -> list[int]:
    """The run's probe: `length` token ids in [0, vocab_size - 1) from SHA-256 of the run id in
    counter mode (the last id is left out: tiny and released vocabularies put end-of-text
    there)."""
    if vocab_size < 2 or length < 2:
        raise ValueError(f"a probe needs ≥ 2 tokens of a vocabulary ≥ 2 ({length}, {vocab_size})")
    out: list[int] = []
    counter = 0
    while len(out) < length:
        block = hashlib.sha256(f"isoexec-canary\0{run_id}\0{counter}".encode()).digest()
        words = (int.from_bytes(block[i : i + 4], "little") for i in (0, 8, 16, 24))
        out += [w % (vocab_size - 1) for w in words]
        counter += 1
    return out[:length]


def pack(values: Sequence[float]) -> bytes:
    """float32 little-endian bytes (the values are float32 logprobs: exact)."""
    if not 0 < len(values) <= MAX_VALUES:
        raise CanaryError(f"a canary carries 1..{MAX_VALUES} values, got {len(values)}")
    packed = struct.pack(f"<{len(values)}f", *values)
    if list(unpack(packed)) != [float(v) for v in values]:
        raise CanaryError("canary values must be float32 (they are logprobs as computed)")
    return packed


def unpack(data: bytes) -> tuple[float, ...]:
    if not data or len(data) % 4 or len(data) // 4 > MAX_VALUES:
        raise CanaryError(f"canary values: {len(data)} bytes is not 1..{MAX_VALUES} float32s")
    values = struct.unpack(f"<{len(data) // 4}f", data)
    if any(math.isnan(v) for v in values):
        raise CanaryError("canary values contain NaN")
    return values


@dataclass(frozen=True)
class CanaryDifference:
    """The first position (1-based: the probe token whose logprob it is) where two canaries'
    bits differ, and both values there."""

    position: int
    expected: float
    got: float

    def describe(self, expected_label: str, got_label: str) -> str:
        return (
            f"canary differs first at probe position {self.position}: {expected_label} "
            f"{self.expected!r} ({_hex(self.expected)}), {got_label} {self.got!r} "
            f"({_hex(self.got)})"
        )


def _hex(v: float) -> str:
    return "0x" + struct.pack("<f", v)[::-1].hex()


def first_difference(expected: Sequence[float], got: Sequence[float]) -> CanaryDifference | None:
    """None when the two are bitwise equal (as float32 bytes, so -0.0 != 0.0)."""
    if len(expected) != len(got):
        raise CanaryError(
            f"canaries of {len(expected)} and {len(got)} values: not the same probe (another "
            "run id or vocabulary?)"
        )
    a, b = struct.pack(f"<{len(expected)}f", *expected), struct.pack(f"<{len(got)}f", *got)
    for i in range(len(expected)):
        if a[4 * i : 4 * i + 4] != b[4 * i : 4 * i + 4]:
            return CanaryDifference(i + 1, float(expected[i]), float(got[i]))
    return None


__all__ = [
    "MAX_VALUES",
    "PROBE_TOKENS",
    "CanaryDifference",
    "CanaryError",
    "canary_probe",
    "first_difference",
    "pack",
    "unpack",
]
