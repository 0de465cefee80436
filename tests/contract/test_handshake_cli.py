"""`isoexec handshake serve|offer|query` through real subprocesses."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

from _contract_testlib import TOKEN, make_contract
from test_cli import CMD


def test_serve_offer_query_and_clean_shutdown(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    good = make_contract(2).save(tmp_path / "good.json")
    bad = make_contract(2, fc1_version={1: 4}).save(tmp_path / "bad.json")
    serve = subprocess.Popen(
        [
            *CMD,
            "handshake",
            "serve",
            "--port",
            "0",
            "--token-file",
            str(token),
            "--expect",
            "trainer=1,engine=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        m = re.match(
            r"isoexec handshake: serving on 127\.0\.0\.1:(\d+) over plaintext \(expecting "
            r"trainer×1, engine×1\)$",
            line.strip(),
        )
        assert m, line
        addr = f"127.0.0.1:{m.group(1)}"
        common = ["--address", addr, "--token-file", str(token), "--timeout", "30"]

        def offer(run: str, side: str, f: Path) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [*CMD, "handshake", "offer", *common, "--run-id", run, "--side", side, str(f)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        procs = [offer("r1", "trainer", good), offer("r1", "engine", good)]
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert outs[0][0].splitlines()[0] == "MATCH (run r1, generation 1)"

        q = subprocess.run(
            [*CMD, "handshake", "query", *common, "--run-id", "r1", "--side", "engine"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (q.returncode, q.stdout.strip()) == (0, "cleared")

        procs = [offer("r2", "trainer", good), offer("r2", "engine", bad)]
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [1, 1], outs
        lines = outs[1][0].splitlines()
        assert lines[0] == "MISMATCH (run r2, generation 1)"
        assert lines[2] == "layers.1.mlp.fc1 (linear): impl version 3 → 4"

        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-token-0123456789")
        r = subprocess.run(
            [
                *CMD,
                "handshake",
                "offer",
                "--address",
                addr,
                "--token-file",
                str(wrong),
                "--run-id",
                "r3",
                "--side",
                "engine",
                str(good),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2
        assert r.stderr.strip() == (
            "isoexec handshake: error: refused: UNAUTHENTICATED: invalid auth token"
        )
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=20)
        finally:
            if serve.poll() is None:
                serve.kill()
    assert serve.returncode == 0


def test_serve_refuses_bad_token_file(tmp_path: Path) -> None:
    r = subprocess.run(
        [*CMD, "handshake", "serve", "--token-file", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("isoexec handshake: error: cannot read token file")
    short = tmp_path / "short"
    short.write_text("abc")
    r = subprocess.run(
        [*CMD, "handshake", "serve", "--token-file", str(short)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "isoexec handshake: error: auth token must be an ASCII string of ≥ 16 chars"
    )
