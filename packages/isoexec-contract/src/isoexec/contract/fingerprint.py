"""Weight fingerprints: did the engine receive exactly the weights the trainer sent?

Both sides hash the weights under canonical (HF) names after a weight sync and compare.
Each tensor is hashed on its own (name, dtype, shape, raw little-endian bytes), and the final
digest is SHA-256 over the sorted (name, tensor digest) list. That makes the result independent
of iteration order while letting a caller stream a large model one tensor at a time (only 32
bytes per tensor are kept), and it tells *which* tensors differ.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DOMAIN = b"isoexec.weights/1\n"


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """SHA-256 (hex) of one tensor's name, dtype, shape and raw bytes (contiguous, on CPU)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        raise ValueError(f"{name}: only dense, materialised tensors can be fingerprinted")
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.to("cpu").contiguous()
    header = json.dumps(
        {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8")
    h = hashlib.sha256()
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    if t.numel():
        raw = t.reshape(-1).view(torch.uint8)
        if sys.byteorder != "little" and t.element_size() > 1:
            raise NotImplementedError("weight fingerprints assume a little-endian host")
        h.update(memoryview(raw.numpy()))
    return h.hexdigest()


@dataclass(frozen=True)
class WeightFingerprint:
    """Digest of a set of named weights, with the per-tensor digests it was built from."""

    digest: str
    tensors: Mapping[str, str] = field(repr=False, compare=False)

    @staticmethod
    def of(
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    ) -> WeightFingerprint:
        """Fingerprint a mapping name → tensor, or stream (name, tensor) pairs."""
        fp = WeightFingerprinter()
        items = weights.items() if isinstance(weights, Mapping) else weights
        for name, tensor in items:
            fp.add(name, tensor)
        return fp.finish()

    @staticmethod
    def from_digests(tensors: Mapping[str, str]) -> WeightFingerprint:
        """The fingerprint of a set whose per-tensor digests (`tensor_digest`) were computed
        apart, e.g. by the ranks that each hold part of a model: the same digest as
        fingerprinting the tensors in one place."""
        h = hashlib.sha256(_DOMAIN)
        for name in sorted(tensors):
            digest = tensors[name]
            if not isinstance(name, str) or not name:
                raise ValueError(f"weight name must be a non-empty string, got {name!r}")
            if not isinstance(digest, str) or len(digest) != 64:
                raise ValueError(f"{name}: a tensor digest is 64 hex digits, got {digest!r}")
            encoded = name.encode("utf-8")
            h.update(len(encoded).to_bytes(8, "little"))
            h.update(encoded)
            h.update(bytes.fromhex(digest))
        return WeightFingerprint(h.hexdigest(), dict(sorted(tensors.items())))

    @property
    def count(self) -> int:
        return len(self.tensors)

    def differing(self, other: WeightFingerprint) -> list[str]:
        """Names whose tensors differ or exist on one side only (sorted)."""
        names = set(self.tensors) | set(other.tensors)
        return sorted(n for n in names if self.tensors.get(n) != other.tensors.get(n))


class WeightFingerprinter:
    """Incremental form: `add(name, tensor)` in any order, then `finish()`."""

    def __init__(self) -> None:
        self._digests: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight name must be a non-empty string, got {name!r}")
        if name in self._digests:
            raise ValueError(f"weight {name!r} given twice")
        self._digests[name] = tensor_digest(name, tensor)

    def finish(self) -> WeightFingerprint:
        return WeightFingerprint.from_digests(self._digests)


def fingerprint_weights(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> WeightFingerprint:
    """Same as `WeightFingerprint.of`."""
    return WeightFingerprint.of(weights)
