"""The numeric canary: the probe, the float32 wire format and the service's rules, over real gRPC.
(Both sides' live canaries are in integration/test_canary.py.)"""

from __future__ import annotations

import math
import struct
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from _contract_testlib import TOKEN, make_contract
from _handshake_testlib import offer_all, participants, raw_call

from isoexec.contract.canary import (
    CanaryError,
    canary_probe,
    first_difference,
    pack,
    unpack,
)
from isoexec.handshake import HandshakeClient
from isoexec.handshake._gen import handshake_pb2 as pb
from isoexec.handshake.types import CANARY_METHOD, HandshakeError

EXPECTED = {"trainer": 1, "engine": 1}
VALUES = [struct.unpack("<f", struct.pack("<f", -0.1 * i - 1.0))[0] for i in range(63)]


def test_the_probe_is_the_run_ids_and_stays_in_the_vocabulary() -> None:
    a = canary_probe("run-1", 512)
    assert len(a) == 64 and a == canary_probe("run-1", 512)
    assert a != canary_probe("run-2", 512)
    assert all(0 <= t < 511 for t in a) and len(set(a)) > 32
    assert len(canary_probe("r", 151936, length=100)) == 100
    with pytest.raises(ValueError):
        canary_probe("r", 1)


def test_values_travel_as_exact_float32() -> None:
    assert list(unpack(pack(VALUES))) == VALUES
    with pytest.raises(CanaryError, match="float32"):
        pack([0.1])  # not a float32 value: the caller did not send what it computed
    for bad in (b"", b"abc", struct.pack("<f", math.nan)):
        with pytest.raises(CanaryError):
            unpack(bad)


def test_first_difference_is_bitwise() -> None:
    assert first_difference(VALUES, list(VALUES)) is None
    changed = list(VALUES)
    bits = struct.unpack("<I", struct.pack("<f", changed[9]))[0]
    changed[9] = struct.unpack("<f", struct.pack("<I", bits + 1))[0]  # one float32 ulp away
    d = first_difference(VALUES, changed)
    assert d is not None and d.position == 10 and d.expected == VALUES[9]
    assert first_difference([0.0], [-0.0]) is not None  # same value, other bits
    with pytest.raises(CanaryError, match="not the same probe"):
        first_difference(VALUES, VALUES[:-1])


def _offer_both(srv, trainer_values, engine_values, version=0):  # type: ignore[no-untyped-def]
    def one(side: str, values: list[float]):  # type: ignore[no-untyped-def]
        with HandshakeClient(srv.address, TOKEN, timeout_s=10) as c:
            return c.offer_canary("run-1", side, 0, version, values)

    with ThreadPoolExecutor(2) as pool:
        t = pool.submit(one, "trainer", trainer_values)
        e = pool.submit(one, "engine", engine_values)
        return t.result(), e.result()


def test_canary_match_and_mismatch_after_a_contract_match(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED)
    offer_all(srv, "run-1", participants(EXPECTED, make_contract(2)))
    t, e = _offer_both(srv, VALUES, VALUES)
    assert t.matched and e.matched and e.reference == "trainer/0" and t.reference == "engine/0"
    # New weights (version 1), and the engine computes one logprob differently.
    other = list(VALUES)
    other[40] = -7.5
    t, e = _offer_both(srv, VALUES, other, version=1)
    assert not t.matched and not e.matched and e.first_position == 41
    assert "canary MISMATCH at weights version 1" in e.summary
    assert f"trainer/0 {VALUES[40]!r}" in e.summary and "engine/0 -7.5" in e.summary


def test_canary_refusals(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(EXPECTED, rendezvous_timeout_s=5)
    with HandshakeClient(srv.address, TOKEN, timeout_s=3) as c:
        with pytest.raises(HandshakeError, match="without a MATCH") as no_match:
            c.offer_canary("run-1", "engine", 0, 0, VALUES)
        assert no_match.value.code == grpc.StatusCode.FAILED_PRECONDITION
        offer_all(srv, "run-1", participants(EXPECTED, make_contract(2)))
        with pytest.raises(HandshakeError, match="no canary from the other side") as alone:
            c.offer_canary("run-1", "engine", 0, 0, VALUES, timeout_s=1.5)
        assert alone.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    t, _ = _offer_both(srv, VALUES, VALUES)
    assert t.matched
    with HandshakeClient(srv.address, TOKEN, timeout_s=3) as c:
        assert c.offer_canary("run-1", "engine", 0, 0, VALUES).matched  # a retry: same answer
        with pytest.raises(HandshakeError, match="other canary values") as again:
            c.offer_canary("run-1", "engine", 0, 0, VALUES[::-1])
        assert again.value.code == grpc.StatusCode.ALREADY_EXISTS
    # Malformed values and a wrong token never reach the board.
    bad = pb.CanaryRequest(run_id="run-1", side="engine", rank=0, logprobs=b"abc")
    err = raw_call(srv, bad.SerializeToString(), method=CANARY_METHOD)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    good = pb.CanaryRequest(run_id="run-1", side="engine", rank=0, logprobs=pack(VALUES))
    err = raw_call(srv, good.SerializeToString(), method=CANARY_METHOD, token="x" * 32)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAUTHENTICATED
