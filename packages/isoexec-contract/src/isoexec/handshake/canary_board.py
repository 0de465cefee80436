"""The service's canary rules: who may offer a canary, whom it is compared with, when it waits.

* Only a participant cleared by the run's MATCH may offer (the canary checks what a MATCH
  promised; before one there is nothing to check): FAILED_PRECONDITION otherwise.
* Canaries are kept per (run, weights version). An offer waits until the other side has
  offered for the same version, then is compared bit for bit with the other side's first
  offer (`reference`): MATCH, or MISMATCH naming the first differing position and both values.
* A participant re-offering the same values (a retry) gets the same verdict; other values for
  the same version are refused (ALREADY_EXISTS): a new version is how new weights are named.
* The wait ends at the call's deadline (DEADLINE_EXCEEDED, naming the side that never came)
  or when the caller goes away. Old versions are dropped first when the board is full.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from isoexec.contract.canary import CanaryError, first_difference
from isoexec.handshake.types import MATCH, MISMATCH, HandshakeError

Key = tuple[str, int]
MAX_SLOTS = 4096  # (run, version) pairs kept


@dataclass(frozen=True)
class CanaryVerdict:
    outcome: str
    run_id: str
    weights_version: int
    reference: str
    first_position: int = 0
    summary: str = ""

    @property
    def matched(self) -> bool:
        return self.outcome == MATCH

    def to_proto(self) -> object:
        from isoexec.handshake._gen import handshake_pb2 as pb

        return pb.CanaryVerdict(
            outcome=pb.Verdict.MATCH if self.matched else pb.Verdict.MISMATCH,
            run_id=self.run_id,
            weights_version=self.weights_version,
            reference=self.reference,
            first_position=self.first_position,
            summary=self.summary,
        )

    @staticmethod
    def from_proto(msg: object) -> CanaryVerdict:
        from isoexec.handshake._gen import handshake_pb2 as pb

        assert isinstance(msg, pb.CanaryVerdict)
        outcomes = {pb.Verdict.MATCH: MATCH, pb.Verdict.MISMATCH: MISMATCH}
        if msg.outcome not in outcomes:  # fail closed
            raise HandshakeError(grpc.StatusCode.INTERNAL, "canary verdict without outcome")
        return CanaryVerdict(
            outcomes[msg.outcome], msg.run_id, msg.weights_version, msg.reference,
            msg.first_position, msg.summary,
        )  # fmt: skip


class CanaryBoard:
    """Thread-safe canary slots; `cleared(run, side, rank) -> (ok, reason)` is the run's MATCH."""

    def __init__(self, cleared: Callable[[str, str, int], tuple[bool, str]]) -> None:
        self._cleared = cleared
        self._cond = threading.Condition()
        self._slots: dict[tuple[str, int], dict[Key, tuple[float, ...]]] = {}
        self._closed = False

    def offer(
        self,
        run_id: str,
        side: str,
        rank: int,
        version: int,
        values: tuple[float, ...],
        *,
        deadline: float,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> CanaryVerdict:
        ok, reason = self._cleared(run_id, side, rank)
        if not ok:
            raise HandshakeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{side}/{rank} offered a canary without a MATCH for run {run_id!r}: {reason}",
            )
        key = (side, rank)
        with self._cond:
            slot = self._slot(run_id, version)
            if key in slot and slot[key] != values:
                raise HandshakeError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"{side}/{rank} already offered other canary values for weights version "
                    f"{version} of run {run_id!r} (new weights take a new version)",
                )
            slot[key] = values
            self._cond.notify_all()
            while True:
                other = next((k for k in slot if k[0] != side), None)
                if other is not None:
                    return _compare(run_id, version, other, slot[other], key, values)
                if self._closed:
                    raise HandshakeError(grpc.StatusCode.UNAVAILABLE, "handshake server stopping")
                left = deadline - time.monotonic()
                if left <= 0 or cancelled():
                    slot.pop(key, None)
                    late = left <= 0
                    raise HandshakeError(
                        grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED,
                        f"no canary from the other side of run {run_id!r} for weights version "
                        f"{version} (only {side} offered)",
                    )
                self._cond.wait(min(0.5, left))

    def _slot(self, run_id: str, version: int) -> dict[Key, tuple[float, ...]]:
        slot = self._slots.get((run_id, version))
        if slot is None:
            while len(self._slots) >= MAX_SLOTS:
                del self._slots[next(iter(self._slots))]  # the oldest
            slot = self._slots[(run_id, version)] = {}
        return slot

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _compare(
    run_id: str,
    version: int,
    ref_key: Key,
    ref: tuple[float, ...],
    key: Key,
    values: tuple[float, ...],
) -> CanaryVerdict:
    ref_label, label = f"{ref_key[0]}/{ref_key[1]}", f"{key[0]}/{key[1]}"
    try:
        diff = first_difference(ref, values)
    except CanaryError as e:
        return CanaryVerdict(MISMATCH, run_id, version, ref_label, 1, f"canary MISMATCH: {e}")
    if diff is None:
        return CanaryVerdict(MATCH, run_id, version, ref_label, 0,
                             f"canary MATCH: {len(values)} logprobs bitwise equal")  # fmt: skip
    text = diff.describe(ref_label, label)
    return CanaryVerdict(MISMATCH, run_id, version, ref_label, diff.position,
                         f"canary MISMATCH at weights version {version}: {text}")  # fmt: skip


__all__ = ["CanaryBoard", "CanaryVerdict"]
