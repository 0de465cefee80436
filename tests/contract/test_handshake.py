"""The handshake: rendezvous verdicts, the weight gate, and every refusal (fail closed)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from _contract_testlib import TOKEN, make_contract
from _handshake_testlib import (
    assert_still_serving,
    offer_all,
    offer_request,
    participants,
    raw_call,
    status,
)

from isoexec.contract.contract import canonical_json
from isoexec.handshake import (
    ContractMismatchError,
    HandshakeClient,
    HandshakeError,
    HandshakeServer,
    Verdict,
)

EXPECTED = {"trainer": 1, "engine": 2}


def test_all_participants_get_the_same_match(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    c = make_contract(2)
    assert not srv.may_receive_weights("run-1", "engine", 0)
    verdicts = offer_all(srv, "run-1", participants(EXPECTED, c), timeout_s=20)
    assert len({v for v in verdicts.values()}) == 1  # identical verdict objects by value
    v = verdicts[("engine", 1)]
    assert isinstance(v, Verdict) and v.matched and v.contract_hash == c.hash
    assert v.generation == 1 and v.diff == () and v.raise_for_mismatch() is v
    assert [p.label for p in v.participants] == ["trainer/0", "engine/0", "engine/1"]
    assert all(srv.may_receive_weights("run-1", s, r) for s, r in verdicts)
    assert srv.verdict("run-1") == v


def test_mismatch_gives_everyone_the_diff(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    bad = make_contract(28, fc1_version={3: 4})
    good = make_contract(28)
    verdicts = offer_all(srv, "run-1", participants(EXPECTED, good, {("engine", 1): bad}))
    assert len(set(verdicts.values())) == 1
    v = verdicts[("trainer", 0)]
    assert isinstance(v, Verdict) and v.outcome == "MISMATCH"
    assert v.summary.startswith("engine/1 differs from trainer/0, engine/0 (contract ")
    assert v.diff[0] == "layers.3.mlp.fc1 (linear): impl version 3 → 4"
    with pytest.raises(ContractMismatchError, match=r"layers\.3\.mlp\.fc1"):
        v.raise_for_mismatch()
    assert not any(srv.may_receive_weights("run-1", s, r) for s, r in verdicts)


def test_weight_gate_follows_latest_offer(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    c = make_contract(2)
    offer_all(srv, "run-1", participants(EXPECTED, c))
    client = HandshakeClient(srv.address, TOKEN, timeout_s=10)
    try:
        assert client.may_receive_weights("run-1", "engine", 0) == (True, "")
        # Engine 0 restarts: the trainer revokes it; it may not receive until it re-offers.
        srv.revoke("run-1", "engine", 0)
        ok, reason = client.may_receive_weights("run-1", "engine", 0)
        assert not ok and reason == "run 'run-1': engine/0 must re-offer its contract"
        assert srv.may_receive_weights("run-1", "engine", 1)
        v = client.offer("run-1", "engine", 0, c)  # re-offer is evaluated at once
        assert v.matched and v.generation == 2
        assert srv.may_receive_weights("run-1", "engine", 0)
        # Engine 1 restarts with a different contract: the whole run is stopped.
        v = client.offer("run-1", "engine", 1, make_contract(2, fc1_version={0: 5}))
        assert v.outcome == "MISMATCH" and v.generation == 3
        assert v.diff[0] == "layers.0.mlp.fc1 (linear): impl version 3 → 5"
        assert not any(srv.may_receive_weights("run-1", *k) for k in participants(EXPECTED))
        ok, reason = client.may_receive_weights("run-1", "trainer", 0)
        assert not ok and reason == "run 'run-1': latest verdict is MISMATCH"
        assert client.may_receive_weights("other-run", "engine", 0) == (
            False,
            "run 'other-run': no offers yet",
        )
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------
# Refusals: each has its status code and message, changes no state, and the server keeps going.
# ---------------------------------------------------------------------------------------------


def test_refuses_claimed_hash_that_does_not_match_bytes(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    err = raw_call(srv, offer_request(make_contract(2), claimed="0" * 64))
    code, details = status(err)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("claimed hash 000000000000… does not equal SHA-256 of the offered")
    assert srv.offered("run-1") == []
    assert_still_serving(srv)


def test_refuses_malformed_claimed_hash(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    code, details = status(raw_call(srv, offer_request(make_contract(2), claimed="XYZ")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "claimed_hash must be 64 lower-case hex characters (SHA-256)"


def test_refuses_unknown_schema(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    d = make_contract(2).to_dict()
    d["schema_version"] = 9
    code, details = status(raw_call(srv, offer_request(canonical_json(d))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "unknown contract schema_version 9 (known: 5)"
    assert_still_serving(srv)


def test_refuses_non_canonical_and_invalid_contracts(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    pretty = make_contract(2).to_bytes().replace(b",", b", ")
    code, details = status(raw_call(srv, offer_request(pretty)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("invalid contract: contract bytes are not canonical")
    code, details = status(raw_call(srv, offer_request(b'{"schema_version":5,"x":1}')))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "invalid contract: contract: unknown field(s) x"


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (None, "missing auth token (metadata 'x-isoexec-token')"),
        ("wrong-token-0123456789", "invalid auth token"),
        (TOKEN + "x", "invalid auth token"),
        ("", "invalid auth token"),
    ],
)
def test_refuses_missing_or_wrong_token(make_server, token: str | None, message: str) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    for method in ("/isoexec.v1.ContractExchange/Offer", "/isoexec.v1.ContractExchange/Query"):
        payload = offer_request(make_contract(2)) if method.endswith("Offer") else b""
        code, details = status(raw_call(srv, payload, token=token, method=method))
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, message)
    # Through the client: refused at once, never retried.
    with HandshakeClient(srv.address, token or "x" * 16, max_attempts=5) as c:
        with pytest.raises(HandshakeError) as ei:
            c.offer("run-1", "engine", 0, make_contract(2))
        assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED and c.attempts_made == 1
    assert srv.offered("run-1") == []
    assert_still_serving(srv)


def test_refuses_oversized_message(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED, max_message_bytes=64 * 1024)
    big = make_contract(60)  # ~150 KB of canonical JSON
    assert len(big.to_bytes()) > 64 * 1024
    code, details = status(raw_call(srv, offer_request(big)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in details
    with HandshakeClient(srv.address, TOKEN, max_message_bytes=64 * 1024) as c:
        with pytest.raises(HandshakeError, match=r"exceeds the 65536-byte limit") as ei:
            c.offer("run-1", "engine", 0, big)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_still_serving(srv)


def test_refuses_malformed_message_and_unknown_fields(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    code, details = status(raw_call(srv, b"\xff\xff\xff\xff"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("malformed OfferRequest (4 bytes): ")
    unknown = offer_request(make_contract(2)) + b"\xa0\x06\x01"  # field 100, varint 1
    code, details = status(raw_call(srv, unknown))
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed OfferRequest: unknown fields",
    )
    assert_still_serving(srv)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"side": "critic"}, "unknown side 'critic' (expected one of: trainer, engine)"),
        ({"rank": 2}, "rank 2 out of range for side 'engine' (expected 0..1)"),
        ({"run_id": ""}, "run_id must be 1-128 chars of [A-Za-z0-9._:-/], starting alphanumeric"),
        (
            {"run_id": "a b"},
            "run_id must be 1-128 chars of [A-Za-z0-9._:-/], starting alphanumeric",
        ),
    ],
)
def test_refuses_unknown_participant(make_server, fields: dict, message: str) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    code, details = status(raw_call(srv, offer_request(make_contract(2), **fields)))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_refuses_duplicate_participant_with_different_contract(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    c = make_contract(2)
    first: dict[str, object] = {}

    def engine0() -> None:
        with HandshakeClient(srv.address, TOKEN, timeout_s=20) as cl:
            first["v"] = cl.offer("run-1", "engine", 0, c)

    t = threading.Thread(target=engine0)
    t.start()
    try:
        _wait_for(lambda: srv.offered("run-1") == ["engine/0"])
        other = make_contract(2, fc1_version={1: 7})
        code, details = status(raw_call(srv, offer_request(other, rank=0)))
        assert code == grpc.StatusCode.ALREADY_EXISTS
        assert details == (
            f"run 'run-1': participant engine/0 already offered contract {c.hash[:12]}… in this "
            f"round; a different contract {other.hash[:12]}… from the same participant is refused"
        )
        assert srv.offered("run-1") == ["engine/0"]  # the original offer is untouched
        # An identical re-offer (a client retry) joins the wait instead; then the others come.
        rest = offer_all(srv, "run-1", {("trainer", 0): c, ("engine", 0): c, ("engine", 1): c})
        assert all(isinstance(v, Verdict) and v.matched for v in rest.values()), rest
    finally:
        t.join(20)
    assert isinstance(first["v"], Verdict) and first["v"].matched


def test_rendezvous_deadline_with_missing_participants(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED, rendezvous_timeout_s=0.5)
    c = make_contract(2)
    results = offer_all(srv, "run-1", {("trainer", 0): c, ("engine", 0): c}, timeout_s=10)
    expected_msg = (
        "run 'run-1': rendezvous deadline (0.5 s) passed; 1 of 3 participants missing: "
        "engine/1; the round was dropped, offer again"
    )
    for err in results.values():
        assert isinstance(err, HandshakeError), err
        assert (err.code, err.details) == (grpc.StatusCode.DEADLINE_EXCEEDED, expected_msg)
    assert srv.offered("run-1") == []  # nothing half-accepted
    assert not srv.may_receive_weights("run-1", "trainer", 0)
    assert_still_serving(srv, "run-1")  # the same run can start over


def test_client_deadline_withdraws_the_offer(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    with HandshakeClient(srv.address, TOKEN) as cl:
        with pytest.raises(HandshakeError) as ei:
            cl.offer("run-1", "engine", 0, make_contract(2), timeout_s=0.6)
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: srv.offered("run-1") == [])


def test_client_gives_up_after_bounded_retries() -> None:
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with HandshakeClient(f"127.0.0.1:{port}", TOKEN, max_attempts=3, backoff_s=0.01) as cl:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=r"gave up after 3 attempts") as ei:
            cl.offer("run-1", "engine", 0, make_contract(2), timeout_s=10)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE and cl.attempts_made == 3
        assert time.monotonic() - t0 < 10


def test_server_refuses_weak_token() -> None:
    with pytest.raises(ValueError, match="≥ 16 chars"):
        HandshakeServer(EXPECTED, "short")


def _wait_for(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.01)
