"""Shared handshake vocabulary: wire names, the verdict, and the one error type.

Kept free of the generated code's import side effects beyond the message classes, so both the
server and the client (and their tests) agree on names in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

SERVICE = "isoexec.v1.ContractExchange"
OFFER_METHOD = f"/{SERVICE}/Offer"
QUERY_METHOD = f"/{SERVICE}/Query"
CANARY_METHOD = f"/{SERVICE}/OfferCanary"
TOKEN_METADATA_KEY = "x-isoexec-token"
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MIN_TOKEN_CHARS = 16
MATCH = "MATCH"
MISMATCH = "MISMATCH"


class HandshakeError(Exception):
    """A refused or failed handshake call: the gRPC status code and the server's reason."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class ContractMismatchError(Exception):
    """Raised by `Verdict.raise_for_mismatch`: the sides must not exchange weights."""

    def __init__(self, verdict: Verdict) -> None:
        text = "\n".join([verdict.summary, *verdict.diff])
        super().__init__(f"execution contracts differ for run {verdict.run_id!r}:\n{text}")
        self.verdict = verdict


@dataclass(frozen=True)
class ParticipantHash:
    """One participant's hash in a verdict, with the settings it offered beside its contract
    (sorted pairs, `side_settings`: reported, never compared)."""

    side: str
    rank: int
    contract_hash: str
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.side}/{self.rank}"


@dataclass(frozen=True)
class Verdict:
    """What every participant of a rendezvous receives: MATCH, or MISMATCH with the diff."""

    outcome: str
    run_id: str
    generation: int
    contract_hash: str
    participants: tuple[ParticipantHash, ...]
    summary: str = ""
    diff: tuple[str, ...] = ()

    @property
    def matched(self) -> bool:
        return self.outcome == MATCH

    def raise_for_mismatch(self) -> Verdict:
        if not self.matched:
            raise ContractMismatchError(self)
        return self

    def to_proto(self) -> object:
        from isoexec.handshake._gen import handshake_pb2 as pb

        return pb.Verdict(
            outcome=pb.Verdict.MATCH if self.matched else pb.Verdict.MISMATCH,
            run_id=self.run_id,
            generation=self.generation,
            contract_hash=self.contract_hash,
            participants=[
                pb.ParticipantHash(
                    side=p.side,
                    rank=p.rank,
                    contract_hash=p.contract_hash,
                    settings=dict(p.settings),
                )
                for p in self.participants
            ],
            summary=self.summary,
            diff=list(self.diff),
        )

    @staticmethod
    def from_proto(msg: object) -> Verdict:
        from isoexec.handshake._gen import handshake_pb2 as pb

        assert isinstance(msg, pb.Verdict)
        if msg.outcome == pb.Verdict.MATCH:
            outcome = MATCH
        elif msg.outcome == pb.Verdict.MISMATCH:
            outcome = MISMATCH
        else:  # fail closed: an unspecified verdict is not a match
            raise HandshakeError(grpc.StatusCode.INTERNAL, "server sent a verdict without outcome")
        return Verdict(
            outcome=outcome,
            run_id=msg.run_id,
            generation=msg.generation,
            contract_hash=msg.contract_hash,
            participants=tuple(
                ParticipantHash(p.side, p.rank, p.contract_hash, tuple(sorted(p.settings.items())))
                for p in msg.participants
            ),
            summary=msg.summary,
            diff=tuple(msg.diff),
        )
