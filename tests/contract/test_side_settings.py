"""Settings offered beside the contract: reported in every verdict, never compared, strict.

(That a speculating engine reports its method and k while its contract says "invariant" is
tested on real engines in integration/test_speculative.py.)"""

from __future__ import annotations

import hashlib
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from _contract_testlib import TOKEN, make_contract
from _handshake_testlib import assert_still_serving, raw_call, status
from test_cli import CMD

from isoexec.handshake import HandshakeClient
from isoexec.handshake._gen import handshake_pb2 as pb
from isoexec.handshake.side_settings import (
    MAX_ENTRIES,
    SideSettingsError,
    check_settings,
    format_settings,
)

SPECULATING = {"speculative": "ngram/3", "tensor_parallel_size": "1"}
TRAINER = {"tensor_parallel_size": "2", "data_parallel_size": "1"}


def test_settings_are_sorted_pairs_and_format_as_key_value() -> None:
    pairs = check_settings(SPECULATING)
    assert pairs == (("speculative", "ngram/3"), ("tensor_parallel_size", "1"))
    assert format_settings(pairs) == "speculative=ngram/3 tensor_parallel_size=1"
    assert check_settings(None) == () and format_settings(()) == ""


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"Speculative": "x"}, "key 'Speculative'"),
        ({"1tp": "x"}, "key '1tp'"),
        ({"k" * 41: "x"}, "1-40 chars"),
        ({"k": "é"}, "printable ASCII"),
        ({"k": "a\nb"}, "printable ASCII"),
        ({"k": "v" * 129}, "at most 128"),
        ({"k": 3}, "printable ASCII"),
        ({f"k{i}": "v" for i in range(MAX_ENTRIES + 1)}, f"at most {MAX_ENTRIES}"),
        (["k", "v"], "must be a mapping"),
    ],
)
def test_malformed_settings_are_refused(raw: Any, message: str) -> None:
    with pytest.raises(SideSettingsError, match=message):
        check_settings(raw)


def _offer(srv: Any, run: str, side: str, settings: dict[str, str], got: dict[str, Any]) -> None:
    with HandshakeClient(srv.address, TOKEN, timeout_s=20) as c:
        got[side] = c.offer(run, side, 0, make_contract(2), settings=settings)


def test_every_verdict_reports_each_participants_settings_without_comparing_them(
    make_server: Any,
) -> None:
    srv = make_server({"trainer": 1, "engine": 1})
    got: dict[str, Any] = {}
    threads = [
        threading.Thread(target=_offer, args=(srv, "r", side, s, got))
        for side, s in (("trainer", TRAINER), ("engine", SPECULATING))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got["trainer"] == got["engine"] and got["engine"].matched  # settings differ: MATCH
    reported = {p.label: dict(p.settings) for p in got["trainer"].participants}
    assert reported == {"trainer/0": TRAINER, "engine/0": SPECULATING}
    # a re-offer (a restarted engine) reports its new settings
    with HandshakeClient(srv.address, TOKEN, timeout_s=20) as c:
        again = c.offer("r", "engine", 0, make_contract(2), settings={"speculative": "none"})
    assert again.matched
    assert {p.label: dict(p.settings) for p in again.participants}["engine/0"] == {
        "speculative": "none"
    }


def test_the_server_refuses_malformed_settings_from_a_dishonest_client(make_server: Any) -> None:
    srv = make_server({"trainer": 1, "engine": 1})
    data = make_contract(2).to_bytes()
    payload = pb.OfferRequest(
        run_id="r", side="engine", rank=0, contract=data,
        claimed_hash=hashlib.sha256(data).hexdigest(), settings={"Bad Key": "x"},
    ).SerializeToString()  # fmt: skip
    code, details = status(raw_call(srv, payload))
    assert code.name == "INVALID_ARGUMENT" and details.startswith("invalid settings: settings key")
    assert_still_serving(srv)


def test_the_cli_offers_settings_and_prints_everyones(make_server: Any, tmp_path: Path) -> None:
    srv = make_server({"trainer": 1, "engine": 1})
    contract = make_contract(2).save(tmp_path / "c.json")
    (tmp_path / "token").write_text(TOKEN)
    got: dict[str, Any] = {}
    t = threading.Thread(target=_offer, args=(srv, "cli", "trainer", TRAINER, got))
    t.start()
    cmd = [*CMD, "handshake", "offer", "--address", srv.address,
           "--token-file", str(tmp_path / "token"), "--run-id", "cli", "--side", "engine",
           "--setting", "speculative=ngram/3", str(contract)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    t.join(30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "MATCH (run cli, generation 1)"
    assert "settings engine/0: speculative=ngram/3" in lines
    assert "settings trainer/0: data_parallel_size=1 tensor_parallel_size=2" in lines
    bad = subprocess.run([*cmd[:-3], "--setting", "no-equals-sign", str(contract)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr
