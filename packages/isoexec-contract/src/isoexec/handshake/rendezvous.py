"""Rendezvous state: who offered what, and when all participants get the same verdict.

Independent of gRPC transport (the server maps `HandshakeError` codes to statuses), so its
rules are easy to read in one place:

* A run expects fixed participants, e.g. `{"trainer": 1, "engine": 4}` → trainer/0,
  engine/0..3. Until all have offered, offers wait (the first round). When the last one
  arrives, everybody gets the same verdict, and the run is *settled*.
* Within the first round an identical re-offer (a client retry) joins the wait; a different
  contract from the same participant is refused (ALREADY_EXISTS) — a duplicate rank.
* The round has a deadline counted from its first offer. When it passes, every waiter gets
  DEADLINE_EXCEEDED naming the missing participants and the round is dropped whole: nothing is
  half-accepted. A waiter whose own call ends (client deadline, cancel) withdraws its offer.
* After the run settled, a participant may offer again (engine restart): it is evaluated at
  once against the other participants' latest offers, and the run's verdict is replaced.
* May (run, side, rank) receive weights? Only if its latest offer is part of a MATCH verdict
  that is the run's current one; any re-offer or `revoke` re-evaluates or resets that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from isoexec.contract.contract import Contract
from isoexec.contract.diff import diff
from isoexec.handshake.types import (
    MATCH,
    MISMATCH,
    HandshakeError,
    ParticipantHash,
    Verdict,
)

Key = tuple[str, int]
MAX_DIFF_LINES = 200
MAX_LINE_CHARS = 1000


def _label(key: Key) -> str:
    return f"{key[0]}/{key[1]}"


@dataclass(eq=False)
class _Offer:
    contract: Contract
    settings: tuple[tuple[str, str], ...] = ()
    waiters: int = 1
    verdict: Verdict | None = None
    failure: str | None = None


@dataclass(eq=False)
class _Run:
    run_id: str
    cond: threading.Condition
    pending: dict[Key, _Offer] = field(default_factory=dict)
    round_deadline: float | None = None
    settled: bool = False
    latest: dict[Key, _Offer] = field(default_factory=dict)
    verdict: Verdict | None = None
    cleared: set[Key] = field(default_factory=set)
    generation: int = 0


class Rendezvous:
    """Thread-safe rendezvous over many runs with the same expected participants."""

    def __init__(
        self,
        expected: Mapping[str, int],
        *,
        timeout_s: float = 300.0,
        max_runs: int = 1024,
    ) -> None:
        if not expected or any(
            not isinstance(s, str) or not s or type(n) is not int or n < 1
            for s, n in expected.items()
        ):
            raise ValueError(f"expected must map side names to positive counts, got {expected}")
        self.expected = dict(expected)
        self.timeout_s = timeout_s
        self.max_runs = max_runs
        self._order = {side: i for i, side in enumerate(self.expected)}
        self._all: list[Key] = [(s, r) for s, n in self.expected.items() for r in range(n)]
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._closed = False

    # -- offers ------------------------------------------------------------------------------

    def check_participant(self, side: str, rank: int) -> None:
        if side not in self.expected:
            raise HandshakeError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown side {side!r} (expected one of: {', '.join(self.expected)})",
            )
        if not 0 <= rank < self.expected[side]:
            raise HandshakeError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {rank} out of range for side {side!r} "
                f"(expected 0..{self.expected[side] - 1})",
            )

    def offer(
        self,
        run_id: str,
        side: str,
        rank: int,
        contract: Contract,
        *,
        deadline: float = float("inf"),
        cancelled: Callable[[], bool] = lambda: False,
        settings: tuple[tuple[str, str], ...] = (),
    ) -> Verdict:
        """Offer and wait for the verdict. `deadline` is this caller's (time.monotonic) limit;
        `cancelled` is polled whenever the caller is woken (see `wake`). `settings`: what the
        participant runs unhashed (`side_settings.check_settings`), reported in the verdict."""
        self.check_participant(side, rank)
        key: Key = (side, rank)
        with self._lock:
            if self._closed:
                raise HandshakeError(grpc.StatusCode.UNAVAILABLE, "handshake server is stopping")
            run = self._runs.get(run_id)
            if run is None:
                if len(self._runs) >= self.max_runs:
                    raise HandshakeError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"too many runs ({self.max_runs}); forget finished runs first",
                    )
                run = _Run(run_id, threading.Condition(self._lock))
                self._runs[run_id] = run
            if run.settled:
                return self._reoffer(run, key, _Offer(contract, settings))
            return self._wait_first_round(run, key, _Offer(contract, settings), deadline, cancelled)

    def _wait_first_round(
        self,
        run: _Run,
        key: Key,
        new: _Offer,
        deadline: float,
        cancelled: Callable[[], bool],
    ) -> Verdict:
        contract = new.contract
        existing = run.pending.get(key)
        if existing is not None and existing.contract.hash != contract.hash:
            raise HandshakeError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"run {run.run_id!r}: participant {_label(key)} already offered contract "
                f"{existing.contract.hash[:12]}… in this round; a different contract "
                f"{contract.hash[:12]}… from the same participant is refused",
            )
        if existing is not None:
            offer = existing
            offer.waiters += 1
        else:
            offer = new
            run.pending[key] = offer
            if run.round_deadline is None:
                run.round_deadline = time.monotonic() + self.timeout_s
        if len(run.pending) == len(self._all):
            verdict = self._evaluate(run, run.pending)
            for o in run.pending.values():
                o.verdict = verdict
            run.latest = run.pending
            run.pending = {}
            run.round_deadline = None
            run.settled = True
            run.cond.notify_all()
        while offer.verdict is None:
            if offer.failure is not None:
                raise HandshakeError(grpc.StatusCode.DEADLINE_EXCEEDED, offer.failure)
            if self._closed:
                self._withdraw(run, key, offer)
                raise HandshakeError(grpc.StatusCode.UNAVAILABLE, "handshake server is stopping")
            now = time.monotonic()
            assert run.round_deadline is not None
            if now >= run.round_deadline:
                msg = (
                    f"run {run.run_id!r}: rendezvous deadline ({self.timeout_s:g} s) passed; "
                    f"{self._missing_text(run)}; the round was dropped, offer again"
                )
                for o in run.pending.values():
                    o.failure = msg
                run.pending = {}
                run.round_deadline = None
                run.cond.notify_all()
                raise HandshakeError(grpc.StatusCode.DEADLINE_EXCEEDED, msg)
            if now >= deadline or cancelled():
                missing = self._missing_text(run)
                self._withdraw(run, key, offer)
                raise HandshakeError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"run {run.run_id!r}: caller's deadline passed while waiting; {missing}",
                )
            run.cond.wait(timeout=max(0.0, min(run.round_deadline, deadline) - now))
        return offer.verdict

    def _withdraw(self, run: _Run, key: Key, offer: _Offer) -> None:
        offer.waiters -= 1
        if offer.waiters <= 0 and run.pending.get(key) is offer:
            del run.pending[key]
            if not run.pending:
                run.round_deadline = None

    def _missing_text(self, run: _Run) -> str:
        missing = [_label(k) for k in self._all if k not in run.pending]
        shown = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        return f"{len(missing)} of {len(self._all)} participants missing: {shown}"

    def _reoffer(self, run: _Run, key: Key, new: _Offer) -> Verdict:
        run.latest[key] = new
        verdict = self._evaluate(run, run.latest)
        run.latest[key].verdict = verdict
        return verdict

    def _evaluate(self, run: _Run, offers: Mapping[Key, _Offer]) -> Verdict:
        run.generation += 1
        keys = sorted(offers, key=lambda k: (self._order[k[0]], k[1]))
        groups: dict[str, list[Key]] = {}
        for k in keys:
            groups.setdefault(offers[k].contract.hash, []).append(k)
        participants = tuple(
            ParticipantHash(k[0], k[1], offers[k].contract.hash, offers[k].settings) for k in keys
        )
        ref_hash = offers[keys[0]].contract.hash
        if len(groups) == 1:
            verdict = Verdict(MATCH, run.run_id, run.generation, ref_hash, participants)
            run.cleared = set(keys)
        else:
            ref = offers[keys[0]].contract
            others = [(h, ks) for h, ks in groups.items() if h != ref_hash]
            summary = "; ".join(
                f"{_names(ks)} differ{'s' if len(ks) == 1 else ''} from "
                f"{_names(groups[ref_hash])} (contract {h[:12]}… vs {ref_hash[:12]}…)"
                for h, ks in others
            )
            lines: list[str] = []
            for _h, ks in others:
                d = diff(ref, offers[ks[0]].contract)
                if len(others) > 1:
                    lines.append(f"[{_names(ks)} vs {_names(groups[ref_hash])}]")
                lines.extend(d.lines)
            if len(lines) > MAX_DIFF_LINES:
                lines = [*lines[:MAX_DIFF_LINES], f"… {len(lines) - MAX_DIFF_LINES} more lines"]
            lines = [ln if len(ln) <= MAX_LINE_CHARS else ln[:MAX_LINE_CHARS] + "…" for ln in lines]
            verdict = Verdict(
                MISMATCH, run.run_id, run.generation, ref_hash, participants, summary, tuple(lines)
            )
            run.cleared = set()
        run.verdict = verdict
        return verdict

    # -- queries and control -----------------------------------------------------------------

    def may_receive_weights(self, run_id: str, side: str, rank: int) -> tuple[bool, str]:
        """(allowed, reason when not). True only after this participant's latest offer got
        MATCH and that MATCH is still the run's verdict."""
        key: Key = (side, rank)
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return False, f"run {run_id!r}: no offers yet"
            if not run.settled:
                return False, f"run {run_id!r}: rendezvous not complete ({self._missing_text(run)})"
            if key not in run.latest:
                return False, f"run {run_id!r}: {_label(key)} has not offered"
            if run.verdict is None or run.verdict.outcome != MATCH:
                return False, f"run {run_id!r}: latest verdict is MISMATCH"
            if key not in run.cleared:
                return False, f"run {run_id!r}: {_label(key)} must re-offer its contract"
            return True, ""

    def revoke(self, run_id: str, side: str, rank: int) -> None:
        """Forget that (side, rank) was cleared (e.g. its engine restarted): it must re-offer."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is not None:
                run.cleared.discard((side, rank))

    def verdict(self, run_id: str) -> Verdict | None:
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else run.verdict

    def offered(self, run_id: str) -> list[str]:
        """Participants with a live offer (pending in the first round, or latest once settled)."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return []
            keys = run.latest if run.settled else run.pending
            return [_label(k) for k in self._all if k in keys]

    def forget(self, run_id: str) -> None:
        with self._lock:
            run = self._runs.pop(run_id, None)
            if run is not None:
                for o in run.pending.values():
                    o.failure = f"run {run_id!r} was forgotten by the server"
                run.cond.notify_all()

    def wake(self) -> None:
        """Wake all waiters so they re-check cancellation (called from gRPC callbacks)."""
        with self._lock:
            for run in self._runs.values():
                run.cond.notify_all()

    def close(self) -> None:
        """Refuse new offers and release every waiter with UNAVAILABLE (clients retry)."""
        with self._lock:
            self._closed = True
            for run in self._runs.values():
                run.cond.notify_all()


def _names(keys: list[Key]) -> str:
    labels = [_label(k) for k in keys]
    if len(labels) <= 4:
        return ", ".join(labels)
    return f"{', '.join(labels[:3])} … {labels[-1]} ({len(labels)} participants)"
