"""Weights from the trainer actor to the engine actors through Ray's object store, in chunks.

The trainer exports its weights in HF names and puts them into the object store in chunks of
at most `chunk_bytes` (a tensor larger than that travels alone): no object holds the whole
model, and no file is written that another node must read. The manifest carries the chunks'
references, the names in each and the trainer's fingerprint of the whole set; an engine
fetches the chunks one at a time, stages each in its workers, and commits: the workers load
only if everything staged hashes to that fingerprint, through the weight gate (MATCH).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from isoexec.contract.fingerprint import WeightFingerprint, WeightFingerprinter

DEFAULT_CHUNK_BYTES = 32 * 2**20


class WeightTransferError(RuntimeError):
    """A chunk of a weight sync is missing or not what the manifest says; nothing loaded."""


@dataclass(frozen=True)
class WeightManifest:
    fingerprint: str  # the trainer's, over every tensor sent (HF names)
    chunks: tuple[Any, ...]  # ray.ObjectRef per chunk
    names: tuple[tuple[str, ...], ...]  # the tensor names in each chunk
    nbytes: int
    digests: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def count(self) -> int:
        return sum(len(n) for n in self.names)


def publish(
    weights: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> WeightManifest:
    """Put `weights` into the object store in bounded chunks (call it where the weights are:
    the trainer actor owns the objects); fingerprint them on the way."""
    import ray

    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    fp = WeightFingerprinter()
    refs: list[Any] = []
    names: list[tuple[str, ...]] = []
    chunk: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal chunk, size
        if chunk:
            refs.append(ray.put(chunk))
            names.append(tuple(chunk))
            chunk, size = {}, 0

    for name, t in weights:
        fp.add(name, t)
        n = t.numel() * t.element_size()
        if chunk and size + n > chunk_bytes:
            flush()
        chunk[name] = t
        size += n
        total += n
    flush()
    done = fp.finish()
    return WeightManifest(done.digest, tuple(refs), tuple(names), total, done.tensors)


def merge(parts: Sequence[WeightManifest]) -> WeightManifest:
    """One manifest for a model published in parts (each trainer rank its share: at PP>1 its
    stage, at EP>1 its experts; `isoexec.megatron.whole_model`), fingerprinted as the whole.
    A weight in two parts is refused: the parts would not say which one to load."""
    digests: dict[str, str] = {}
    for part in parts:
        twice = sorted(set(digests) & set(part.digests))
        if twice:
            raise WeightTransferError(f"weights published by two trainer ranks: {twice[:3]}")
        if len(part.digests) != part.count:
            raise WeightTransferError("a manifest part without its per-tensor digests")
        digests.update(part.digests)
    return WeightManifest(
        WeightFingerprint.from_digests(digests).digest,
        tuple(c for p in parts for c in p.chunks),
        tuple(n for p in parts for n in p.names),
        sum(p.nbytes for p in parts),
        digests,
    )


def fetch(manifest: WeightManifest, timeout_s: float = 300.0) -> Iterator[dict[str, torch.Tensor]]:
    """The manifest's chunks, one at a time; `WeightTransferError` for a chunk that went
    missing from the object store (its owner or node lost, or freed) or holds other names."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    n = len(manifest.chunks)
    for i, (ref, names) in enumerate(zip(manifest.chunks, manifest.names, strict=True)):
        try:
            chunk = ray.get(ref, timeout=timeout_s)
        except (GetTimeoutError, RayError) as e:
            raise WeightTransferError(
                f"weight chunk {i + 1}/{n} ({len(names)} tensors from {names[0]!r}) is missing "
                f"from Ray's object store ({type(e).__name__}); nothing was loaded"
            ) from None
        if tuple(chunk) != names:
            raise WeightTransferError(
                f"weight chunk {i + 1}/{n} holds {sorted(chunk)[:3]}…, the manifest says "
                f"{list(names)[:3]}…; nothing was loaded"
            )
        yield chunk


def free(manifest: WeightManifest) -> None:
    """Drop the chunks from the object store once every engine has committed (or refused)."""
    from ray._private.internal_api import free as ray_free

    ray_free(list(manifest.chunks))


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "WeightManifest",
    "WeightTransferError",
    "fetch",
    "free",
    "merge",
    "publish",
]
