"""The client every trainer rank and engine worker uses to offer its contract.

Transient failures (server not up yet, restarting, momentarily full) are retried with
exponential backoff and jitter, within one overall deadline and a bounded number of attempts;
refusals (bad token, bad contract, duplicate, rendezvous deadline) are raised at once as
`HandshakeError` with the server's reason, because retrying cannot fix them.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Mapping
from typing import Any

import grpc

from isoexec.contract.canary import pack
from isoexec.contract.contract import Contract
from isoexec.handshake._gen import handshake_pb2 as pb
from isoexec.handshake.canary_board import CanaryVerdict
from isoexec.handshake.side_settings import check_settings
from isoexec.handshake.tls import ClientTLS
from isoexec.handshake.types import (
    CANARY_METHOD,
    DEFAULT_MAX_MESSAGE_BYTES,
    OFFER_METHOD,
    QUERY_METHOD,
    TOKEN_METADATA_KEY,
    HandshakeError,
    Verdict,
)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
_TLS_FAILURE_MARKS = ("ssl", "certificate", "tls handshake", "handshake failed")


def _is_tls_failure(details: str) -> bool:
    low = details.lower()
    return any(mark in low for mark in _TLS_FAILURE_MARKS)


class HandshakeClient:
    """`HandshakeClient("host:port", token).offer(run_id, side, rank, contract) -> Verdict`.

    `tls` (`ClientTLS`): connect over TLS, trusting its CA (and presenting its certificate for
    mutual TLS). `timeout_s` is the overall limit of one `offer` (all attempts, including the
    wait for the other participants); `max_attempts` bounds retries of transient failures.
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        timeout_s: float = 600.0,
        max_attempts: int = 8,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: ClientTLS | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be ≥ 1")
        self.address = address
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_message_bytes = max_message_bytes
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Reconnect promptly after a server restart instead of gRPC's slow default.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.tls = tls
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, tls.credentials(), options=options)
        self._offer = self._channel.unary_unary(
            OFFER_METHOD,
            request_serializer=pb.OfferRequest.SerializeToString,
            response_deserializer=pb.Verdict.FromString,
        )
        self._query = self._channel.unary_unary(
            QUERY_METHOD,
            request_serializer=pb.QueryRequest.SerializeToString,
            response_deserializer=pb.QueryReply.FromString,
        )
        self._canary = self._channel.unary_unary(
            CANARY_METHOD,
            request_serializer=pb.CanaryRequest.SerializeToString,
            response_deserializer=pb.CanaryVerdict.FromString,
        )
        self.attempts_made = 0  # of the last call; tests and logs read it

    def offer(
        self,
        run_id: str,
        side: str,
        rank: int,
        contract: Contract | bytes,
        *,
        timeout_s: float | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> Verdict:
        """Offer this participant's contract and wait for the run's verdict.

        `settings`: what this participant runs that its contract does not hash, reported in
        the verdict and never compared (`side_settings`; checked here before sending).
        Returns MATCH or MISMATCH (call `.raise_for_mismatch()` to stop on a mismatch);
        raises `HandshakeError` when the offer is refused or the deadline passes.
        """
        data = contract.to_bytes() if isinstance(contract, Contract) else bytes(contract)
        claimed = hashlib.sha256(data).hexdigest()
        req = pb.OfferRequest(
            run_id=run_id,
            side=side,
            rank=rank,
            contract=data,
            claimed_hash=claimed,
            settings=dict(check_settings(settings)),
        )
        if req.ByteSize() > self.max_message_bytes:
            raise HandshakeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"offer of {req.ByteSize()} bytes exceeds the {self.max_message_bytes}-byte limit",
            )
        reply = self._call(self._offer, req, timeout_s)
        return Verdict.from_proto(reply)

    def offer_canary(
        self,
        run_id: str,
        side: str,
        rank: int,
        weights_version: int,
        logprobs: list[float],
        *,
        timeout_s: float | None = None,
    ) -> CanaryVerdict:
        """Offer this participant's canary (`isoexec.contract.canary`) for a weights version
        and wait for the other side's: MATCH, or MISMATCH naming the first differing position
        and both values. Needs the run's MATCH first (FAILED_PRECONDITION otherwise)."""
        req = pb.CanaryRequest(
            run_id=run_id, side=side, rank=rank, weights_version=weights_version,
            logprobs=pack(logprobs),
        )  # fmt: skip
        return CanaryVerdict.from_proto(self._call(self._canary, req, timeout_s))

    def may_receive_weights(
        self, run_id: str, side: str, rank: int, *, timeout_s: float | None = 30.0
    ) -> tuple[bool, str]:
        """Ask the server whether (run, side, rank) is cleared to receive weights."""
        reply = self._call(
            self._query, pb.QueryRequest(run_id=run_id, side=side, rank=rank), timeout_s
        )
        return reply.may_receive_weights, reply.reason

    def _call(self, method: Any, req: Any, timeout_s: float | None) -> Any:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        delay = self.backoff_s
        self.attempts_made = 0
        while True:
            self.attempts_made += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HandshakeError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no answer from {self.address} within the deadline "
                    f"({self.attempts_made - 1} attempts)",
                )
            try:
                return method(req, timeout=remaining, metadata=self._metadata)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
                details = (e.details() if hasattr(e, "details") else "") or str(code)
                retryable = code in _RETRYABLE and "larger than max" not in details
                if retryable and _is_tls_failure(details):  # a retry cannot fix a certificate
                    raise HandshakeError(
                        code, f"TLS handshake with {self.address} failed: {details}"
                    ) from None
                if not retryable or self.attempts_made >= self.max_attempts:
                    if retryable:
                        details = f"{details} (gave up after {self.attempts_made} attempts)"
                    raise HandshakeError(code, details) from None
            sleep = min(delay, self.max_backoff_s) * random.uniform(0.5, 1.0)
            time.sleep(max(0.0, min(sleep, deadline - time.monotonic())))
            delay *= 2

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
