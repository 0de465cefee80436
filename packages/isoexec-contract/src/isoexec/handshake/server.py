"""The ContractExchange gRPC server: hosted in-process by the trainer, or standalone via
`isoexec handshake serve`.

Fail closed: every request is authenticated (constant-time token compare), size-limited,
parsed strictly (unknown protobuf fields refused), hash-checked against the offered bytes and
parsed as a canonical contract before it may join a rendezvous. A refused call changes no
state, and one caller's bad request never affects the others.

The generated `_pb2_grpc` stubs are not used at runtime: handlers are registered generically
so that a malformed message can be answered with INVALID_ARGUMENT and a reason (the stock
deserializer path answers INTERNAL), and so the runtime does not depend on the exact grpcio
version the stubs were generated with.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError

from isoexec.contract.canary import CanaryError, unpack
from isoexec.contract.contract import Contract, ContractError, SchemaVersionError
from isoexec.handshake._gen import handshake_pb2 as pb
from isoexec.handshake.canary_board import CanaryBoard
from isoexec.handshake.rendezvous import Rendezvous
from isoexec.handshake.side_settings import SideSettingsError, check_settings, format_settings
from isoexec.handshake.tls import ServerTLS, check_plaintext_allowed
from isoexec.handshake.types import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MIN_TOKEN_CHARS,
    SERVICE,
    TOKEN_METADATA_KEY,
    HandshakeError,
    Verdict,
)

log = logging.getLogger(__name__)

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-/]{0,127}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")
_DEADLINE_MARGIN_S = 0.05


def _deadline(context: grpc.ServicerContext) -> float:
    """The monotonic time by which a waiting call must answer (its own deadline, less a margin
    so that the answer still reaches it)."""
    remaining = context.time_remaining()
    if remaining is None:
        return float("inf")
    return time.monotonic() + max(0.0, remaining - _DEADLINE_MARGIN_S)


class _Malformed:
    """Stands in for a request that did not parse, so the handler can say why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _strict_parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            msg = cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            return _Malformed(f"malformed {cls.DESCRIPTOR.name} ({len(data)} bytes): {e}")
        if len(unknown_fields.UnknownFieldSet(msg)):
            return _Malformed(f"malformed {cls.DESCRIPTOR.name}: unknown fields")
        return msg

    return parse


def _serialize(msg: Any) -> bytes:
    return msg.SerializeToString()


class HandshakeServer:
    """Hosts the contract rendezvous.

    >>> with HandshakeServer({"trainer": 1, "engine": 2}, token) as srv:
    ...     port = srv.port
    ...     # participants call HandshakeClient(f"127.0.0.1:{port}", token).offer(...)
    ...     srv.may_receive_weights("run-1", "engine", 0)

    `tls` (`ServerTLS`): serve over TLS, with mutual TLS when it names a client CA. Without it
    a non-loopback `host` is refused unless `insecure=True` (the token would travel in the
    clear). `rendezvous_timeout_s` bounds a round (counted from its first offer);
    `max_message_bytes` caps requests and replies; `max_workers` threads serve calls (waiting
    offers hold one each; calls beyond it get RESOURCE_EXHAUSTED and the client retries).
    """

    def __init__(
        self,
        expected: Mapping[str, int],
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        rendezvous_timeout_s: float = 300.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_workers: int | None = None,
        max_runs: int = 1024,
        tls: ServerTLS | None = None,
        insecure: bool = False,
    ) -> None:
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or not token.isascii():
            raise ValueError(f"auth token must be an ASCII string of ≥ {MIN_TOKEN_CHARS} chars")
        if tls is None:  # plaintext only on loopback, or when asked for explicitly
            check_plaintext_allowed(host, insecure=insecure)
        self.tls = tls
        self.rendezvous = Rendezvous(expected, timeout_s=rendezvous_timeout_s, max_runs=max_runs)
        self.canaries = CanaryBoard(self.rendezvous.may_receive_weights)
        self._token = token.encode("ascii")
        self.host = host
        self._requested_port = port
        self.max_message_bytes = max_message_bytes
        total = sum(self.rendezvous.expected.values())
        self.max_workers = max_workers or max(32, 2 * total + 16)
        self._server: grpc.Server | None = None
        self._stopped = False
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and serve in background threads; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("server already started")
        if self._stopped:
            raise RuntimeError("a stopped HandshakeServer cannot restart; create a new one")
        opts = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.max_workers, thread_name_prefix="isoexec-handshake"
            ),
            options=opts,
            maximum_concurrent_rpcs=self.max_workers,
        )
        handlers = {
            "Offer": grpc.unary_unary_rpc_method_handler(
                self._offer,
                request_deserializer=_strict_parser(pb.OfferRequest),
                response_serializer=_serialize,
            ),
            "Query": grpc.unary_unary_rpc_method_handler(
                self._query,
                request_deserializer=_strict_parser(pb.QueryRequest),
                response_serializer=_serialize,
            ),
            "OfferCanary": grpc.unary_unary_rpc_method_handler(
                self._offer_canary,
                request_deserializer=_strict_parser(pb.CanaryRequest),
                response_serializer=_serialize,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        host = f"[{self.host}]" if ":" in self.host else self.host
        addr = f"{host}:{self._requested_port}"
        if self.tls is None:
            port = server.add_insecure_port(addr)
        else:
            port = server.add_secure_port(addr, self.tls.credentials())
        if port == 0:
            raise OSError(f"cannot bind {self.host}:{self._requested_port}")
        server.start()
        self._server, self.port = server, port
        log.info("isoexec handshake serving on %s:%d", self.host, port)
        return port

    def stop(self, grace: float | None = 1.0) -> None:
        """Release waiters (they get UNAVAILABLE and retry elsewhere/later) and stop."""
        if self._server is None:
            return
        self._stopped = True
        self.rendezvous.close()
        self.canaries.close()
        self._server.stop(grace).wait()
        self._server = None

    def wait(self) -> None:
        if self._server is not None:
            self._server.wait_for_termination()

    def __enter__(self) -> HandshakeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    # -- in-process queries (the trainer side asks before sending weights) ---------------------

    def may_receive_weights(self, run_id: str, side: str, rank: int) -> bool:
        return self.rendezvous.may_receive_weights(run_id, side, rank)[0]

    def verdict(self, run_id: str) -> Verdict | None:
        return self.rendezvous.verdict(run_id)

    def revoke(self, run_id: str, side: str, rank: int) -> None:
        self.rendezvous.revoke(run_id, side, rank)

    def offered(self, run_id: str) -> list[str]:
        return self.rendezvous.offered(run_id)

    # -- handlers ----------------------------------------------------------------------------

    def _authenticate(self, context: grpc.ServicerContext) -> None:
        tokens = [v for k, v in (context.invocation_metadata() or ()) if k == TOKEN_METADATA_KEY]
        if not tokens:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing auth token (metadata {TOKEN_METADATA_KEY!r})",
            )
        given = tokens[0]
        given_b = given.encode("utf-8", "replace") if isinstance(given, str) else bytes(given)
        if len(tokens) != 1 or not hmac.compare_digest(given_b, self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid auth token")

    def _guard(self, context: grpc.ServicerContext, request: object) -> None:
        self._authenticate(context)
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

    def _participant(self, context: grpc.ServicerContext, req: Any) -> None:
        if not _RUN_ID.match(req.run_id):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "run_id must be 1-128 chars of [A-Za-z0-9._:-/], starting alphanumeric",
            )
        try:
            self.rendezvous.check_participant(req.side, req.rank)
        except HandshakeError as e:
            context.abort(e.code, e.details)

    def _offer(self, req: Any, context: grpc.ServicerContext) -> Any:
        self._guard(context, req)
        self._participant(context, req)
        if not _HASH.match(req.claimed_hash):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "claimed_hash must be 64 lower-case hex characters (SHA-256)",
            )
        actual = hashlib.sha256(req.contract).hexdigest()
        if not hmac.compare_digest(actual, req.claimed_hash):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"claimed hash {req.claimed_hash[:12]}… does not equal SHA-256 of the offered "
                f"contract bytes ({actual[:12]}…)",
            )
        try:
            contract = Contract.from_bytes(req.contract, require_canonical=True)
        except SchemaVersionError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ContractError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid contract: {e}")
        try:
            settings = check_settings(dict(req.settings))
        except SideSettingsError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid settings: {e}")
        context.add_callback(self.rendezvous.wake)
        try:
            verdict = self.rendezvous.offer(
                req.run_id,
                req.side,
                req.rank,
                contract,
                deadline=_deadline(context),
                cancelled=lambda: not context.is_active(),
                settings=settings,
            )
        except HandshakeError as e:
            context.abort(e.code, e.details)
        log.info("isoexec offer %s/%d run %s: contract %s… [%s]: %s", req.side, req.rank,
                 req.run_id, contract.hash[:12], format_settings(settings),
                 verdict.outcome)  # fmt: skip
        return verdict.to_proto()

    def _offer_canary(self, req: Any, context: grpc.ServicerContext) -> Any:
        self._guard(context, req)
        self._participant(context, req)
        try:
            values = unpack(req.logprobs)
        except CanaryError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        context.add_callback(self.canaries.wake)
        try:
            verdict = self.canaries.offer(
                req.run_id,
                req.side,
                req.rank,
                req.weights_version,
                values,
                deadline=_deadline(context),
                cancelled=lambda: not context.is_active(),
            )
        except HandshakeError as e:
            context.abort(e.code, e.details)
        log.info("isoexec canary %s/%d run %s: %s", req.side, req.rank, req.run_id, verdict.summary)
        return verdict.to_proto()

    def _query(self, req: Any, context: grpc.ServicerContext) -> Any:
        self._guard(context, req)
        self._participant(context, req)
        ok, reason = self.rendezvous.may_receive_weights(req.run_id, req.side, req.rank)
        return pb.QueryReply(may_receive_weights=ok, reason=reason)
