"""Helpers for talking to a test server: raw calls (to send what no honest client would)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from _contract_testlib import TOKEN, make_contract

from isoexec.contract.contract import Contract
from isoexec.handshake import HandshakeClient, HandshakeServer, Verdict
from isoexec.handshake._gen import handshake_pb2 as pb
from isoexec.handshake.types import OFFER_METHOD, TOKEN_METADATA_KEY


def raw_call(
    server: HandshakeServer,
    payload: bytes,
    *,
    token: str | None = TOKEN,
    timeout: float = 5.0,
    method: str = OFFER_METHOD,
) -> grpc.RpcError | bytes:
    """Send raw request bytes; return the reply bytes or the RpcError (never raise it)."""
    opts = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(server.address, options=opts) as ch:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        md = () if token is None else ((TOKEN_METADATA_KEY, token),)
        try:
            return call(payload, timeout=timeout, metadata=md)
        except grpc.RpcError as e:
            return e


def offer_request(
    contract: Contract | bytes,
    *,
    run_id: str = "run-1",
    side: str = "engine",
    rank: int = 0,
    claimed: str | None = None,
) -> bytes:
    data = contract.to_bytes() if isinstance(contract, Contract) else contract
    return pb.OfferRequest(
        run_id=run_id,
        side=side,
        rank=rank,
        contract=data,
        claimed_hash=claimed if claimed is not None else hashlib.sha256(data).hexdigest(),
    ).SerializeToString()


def offer_all(
    server: HandshakeServer,
    run_id: str,
    contracts: dict[tuple[str, int], Contract],
    **client_kw: object,
) -> dict[tuple[str, int], Verdict | Exception]:
    """Every participant offers concurrently, each through its own client (channel)."""

    def one(key: tuple[str, int]) -> Verdict | Exception:
        with HandshakeClient(server.address, TOKEN, **client_kw) as c:  # type: ignore[arg-type]
            try:
                return c.offer(run_id, key[0], key[1], contracts[key])
            except Exception as e:
                return e

    with ThreadPoolExecutor(max_workers=len(contracts)) as pool:
        return dict(zip(contracts, pool.map(one, contracts), strict=True))


def participants(
    expected: dict[str, int],
    contract: Contract | None = None,
    override: dict[tuple[str, int], Contract] | None = None,
) -> dict[tuple[str, int], Contract]:
    c = contract or make_contract(2)
    out = {(s, r): c for s, n in expected.items() for r in range(n)}
    out.update(override or {})
    return out


def assert_still_serving(server: HandshakeServer, run_id: str = "still-serving") -> None:
    """A full, good rendezvous still works (after whatever refusal came before)."""
    exp = server.rendezvous.expected
    verdicts = offer_all(server, run_id, participants(exp), timeout_s=20)
    assert all(isinstance(v, Verdict) and v.matched for v in verdicts.values()), verdicts


def status(err: object) -> tuple[grpc.StatusCode, str]:
    assert isinstance(err, grpc.RpcError), f"expected an error, got {err!r}"
    return err.code(), err.details()  # type: ignore[attr-defined]


Check = Callable[[object], None]
