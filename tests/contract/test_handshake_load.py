"""The handshake under load, across a server restart, and against garbage bytes."""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from _contract_testlib import TOKEN, make_contract
from _handshake_testlib import (
    assert_still_serving,
    offer_request,
    participants,
    raw_call,
    status,
)

from isoexec.handshake import HandshakeClient, HandshakeServer, Verdict
from isoexec.handshake.types import QUERY_METHOD


def _timed_offers(srv: HandshakeServer, run_id: str, contracts: dict) -> tuple[dict, list, float]:
    start = threading.Barrier(len(contracts))

    def one(key: tuple[str, int]) -> tuple[Verdict | Exception, float]:
        with HandshakeClient(srv.address, TOKEN, timeout_s=60) as c:
            start.wait()
            t0 = time.perf_counter()
            try:
                v: Verdict | Exception = c.offer(run_id, key[0], key[1], contracts[key])
            except Exception as e:
                v = e
            return v, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(contracts)) as pool:
        out = dict(zip(contracts, pool.map(one, contracts), strict=True))
    wall = time.perf_counter() - t0
    return {k: v for k, (v, _) in out.items()}, [lat for _, lat in out.values()], wall


def test_64_concurrent_participants_all_get_the_correct_verdict(make_server) -> None:  # type: ignore[no-untyped-def]
    expected = {"trainer": 1, "engine": 63}
    srv = make_server(expected)
    good = make_contract(8)
    contracts = participants(expected, good)
    verdicts, lat, wall = _timed_offers(srv, "load-match", contracts)
    assert all(isinstance(v, Verdict) and v.matched for v in verdicts.values()), verdicts
    assert len(set(verdicts.values())) == 1
    assert next(iter(verdicts.values())).contract_hash == good.hash
    assert all(srv.may_receive_weights("load-match", s, r) for s, r in contracts)
    q = statistics.quantiles(lat, n=20)
    print(
        f"\n[handshake load] 64 participants, MATCH: wall {wall * 1e3:.0f} ms, "
        f"{len(lat) / wall:.0f} offers/s, latency p50 {q[9] * 1e3:.0f} ms, "
        f"p95 {q[18] * 1e3:.0f} ms, max {max(lat) * 1e3:.0f} ms"
    )

    bad = make_contract(8, fc1_version={5: 4})
    contracts = participants(expected, good, {("engine", 41): bad})
    verdicts, lat, wall = _timed_offers(srv, "load-mismatch", contracts)
    assert len(set(verdicts.values())) == 1
    v = verdicts[("engine", 0)]
    assert isinstance(v, Verdict) and v.outcome == "MISMATCH"
    assert v.summary.startswith("engine/41 differs from trainer/0, engine/0, engine/1 … engine/62")
    assert v.diff == ("layers.5.mlp.fc1 (linear): impl version 3 → 4",)
    assert not any(srv.may_receive_weights("load-mismatch", s, r) for s, r in contracts)
    print(
        f"[handshake load] 64 participants, MISMATCH: wall {wall * 1e3:.0f} ms, "
        f"latency max {max(lat) * 1e3:.0f} ms"
    )


def test_server_killed_and_restarted_while_clients_retry() -> None:
    expected = {"trainer": 1, "engine": 2}
    c = make_contract(2)
    first = HandshakeServer(expected, TOKEN, port=0)
    port = first.start()
    second: HandshakeServer | None = None
    results: dict[tuple[str, int], object] = {}
    attempts: dict[tuple[str, int], int] = {}

    def participant(key: tuple[str, int]) -> None:
        with HandshakeClient(
            f"127.0.0.1:{port}",
            TOKEN,
            timeout_s=30,
            max_attempts=30,
            backoff_s=0.05,
            max_backoff_s=0.5,
        ) as cl:
            try:
                results[key] = cl.offer("restart-run", key[0], key[1], c)
            except Exception as e:
                results[key] = e
            attempts[key] = cl.attempts_made

    early = [
        threading.Thread(target=participant, args=(k,)) for k in [("trainer", 0), ("engine", 0)]
    ]
    try:
        for t in early:
            t.start()
        deadline = time.monotonic() + 10
        while first.offered("restart-run") != ["trainer/0", "engine/0"]:
            assert time.monotonic() < deadline, "offers did not arrive"
            time.sleep(0.01)
        first.stop(grace=0)  # the server dies with two participants waiting
        time.sleep(0.3)  # they retry against nothing for a while
        second = HandshakeServer(expected, TOKEN, port=port)
        assert second.start() == port
        participant(("engine", 1))
        for t in early:
            t.join(30)
    finally:
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)
    assert all(isinstance(v, Verdict) and v.matched for v in results.values()), results
    assert len(results) == 3
    assert attempts[("trainer", 0)] >= 2 and attempts[("engine", 0)] >= 2  # they did retry
    print(f"\n[handshake restart] attempts per participant: {attempts}")


def test_fuzz_random_and_truncated_bytes_never_crash_the_server(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server({"trainer": 1, "engine": 2})
    rng = random.Random(1234)
    valid = offer_request(make_contract(2))
    payloads: list[bytes] = [b""]
    payloads += [rng.randbytes(rng.randint(1, 512)) for _ in range(150)]
    payloads += [valid[: rng.randint(0, len(valid) - 1)] for _ in range(100)]
    payloads += [
        valid[:n] + rng.randbytes(rng.randint(1, 64))
        for n in (rng.randint(0, len(valid)) for _ in range(50))
    ]
    codes: dict[str, int] = {}
    t0 = time.monotonic()
    with grpc.insecure_channel(srv.address) as ch:
        calls = {
            m: ch.unary_unary(m, request_serializer=None, response_deserializer=None)
            for m in ("/isoexec.v1.ContractExchange/Offer", QUERY_METHOD)
        }
        for i, p in enumerate(payloads):
            method = QUERY_METHOD if i % 5 == 4 else "/isoexec.v1.ContractExchange/Offer"
            try:
                calls[method](p, timeout=2.0, metadata=(("x-isoexec-token", TOKEN),))
                codes["OK"] = codes.get("OK", 0) + 1  # an empty Query is a valid (denied) query
                assert method == QUERY_METHOD
            except grpc.RpcError as e:
                codes[e.code().name] = codes.get(e.code().name, 0) + 1
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), p)
                assert e.details(), p
    elapsed = time.monotonic() - t0
    print(f"\n[handshake fuzz] {len(payloads)} payloads in {elapsed:.1f} s: {codes}")
    assert srv.rendezvous.offered("run-1") == []  # nothing accepted
    # Without a token, garbage learns nothing beyond UNAUTHENTICATED.
    for p in payloads[:20]:
        assert status(raw_call(srv, p, token=None))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert_still_serving(srv)
