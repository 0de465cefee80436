"""Which Python, IsoExec and torch an actor runs: the driver refuses actors that differ.

A Ray cluster is assembled from nodes that were set up separately; an actor on a node with
another Python or another IsoExec would declare a contract that differs for a reason the
site diff does not name (or, worse, pickle objects the driver reads differently). So every
actor reports its identity first and the driver compares it with its own.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from importlib import metadata


class ActorRuntimeMismatchError(RuntimeError):
    """An actor runs another Python, IsoExec or torch than the driver."""


@dataclass(frozen=True)
class RuntimeIdentity:
    python: str
    isoexec: str
    torch: str

    @staticmethod
    def here() -> RuntimeIdentity:
        import torch

        try:  # a worker whose environment lacks IsoExec's metadata (e.g. rebuilt elsewhere)
            isoexec = metadata.version("isoexec-contract")
        except metadata.PackageNotFoundError:
            isoexec = "not installed"
        return RuntimeIdentity(
            python=platform.python_version(), isoexec=isoexec, torch=str(torch.__version__)
        )


def require_same(driver: RuntimeIdentity, actor: RuntimeIdentity, who: str) -> None:
    """Raise `ActorRuntimeMismatchError` naming every field where `actor` differs."""
    d, a = asdict(driver), asdict(actor)
    diff = [f"{k}: driver {d[k]}, actor {a[k]}" for k in d if d[k] != a[k]]
    if diff:
        raise ActorRuntimeMismatchError(
            f"{who} runs another runtime than the driver ({'; '.join(diff)}); install the "
            "same versions on every node"
        )


__all__ = ["ActorRuntimeMismatchError", "RuntimeIdentity", "require_same"]
