"""The handshake over TLS and mutual TLS, with certificates made here (`cryptography`).

MATCH over TLS and over mutual TLS; refused: a client trusting another CA, a plaintext client
to a TLS server, a server certificate that has expired, a mutual-TLS server and a client
without a certificate, plaintext on a non-loopback address without `--insecure`, and a token
on the command line (there is no such flag: file or environment only).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))
from _contract_testlib import make_contract
from pki import make_pki

from isoexec.handshake.client import HandshakeClient
from isoexec.handshake.server import HandshakeServer
from isoexec.handshake.tls import ClientTLS, ServerTLS, TLSConfigError
from isoexec.handshake.types import HandshakeError


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


TOKEN = secrets.token_hex(16)


def _offer(port: int, tls: ClientTLS | None, run_id: str) -> str:
    with HandshakeClient(f"127.0.0.1:{port}", TOKEN, tls=tls, timeout_s=8, max_attempts=2) as c:
        return c.offer(run_id, "trainer", 0, make_contract(1)).outcome


def _match(port: int, tls: ClientTLS | None, run_id: str) -> tuple[str, str]:
    import threading

    got: dict[str, str] = {}
    t = threading.Thread(target=lambda: got.setdefault("engine", _engine(port, tls, run_id)))
    t.start()
    trainer = _offer(port, tls, run_id)
    t.join(20)
    return trainer, got["engine"]


def _engine(port: int, tls: ClientTLS | None, run_id: str) -> str:
    with HandshakeClient(f"127.0.0.1:{port}", TOKEN, tls=tls, timeout_s=8, max_attempts=2) as c:
        return c.offer(run_id, "engine", 0, make_contract(1)).outcome


def test_match_over_tls_and_mutual_tls(pki: dict[str, str]) -> None:
    tls = ServerTLS(pki["server"], pki["server_key"])
    with HandshakeServer({"trainer": 1, "engine": 1}, TOKEN, tls=tls) as srv:
        assert _match(srv.port, ClientTLS(pki["ca"]), "tls") == ("MATCH", "MATCH")
    mtls = ServerTLS(pki["server"], pki["server_key"], client_ca=pki["ca"])
    with HandshakeServer({"trainer": 1, "engine": 1}, TOKEN, tls=mtls) as srv:
        client = ClientTLS(pki["ca"], pki["client"], pki["client_key"])
        assert _match(srv.port, client, "mtls") == ("MATCH", "MATCH")


def test_a_client_trusting_another_ca_is_refused(pki: dict[str, str]) -> None:
    with HandshakeServer(
        {"trainer": 1}, TOKEN, tls=ServerTLS(pki["server"], pki["server_key"])
    ) as srv:
        with pytest.raises(HandshakeError, match="TLS handshake"):
            _offer(srv.port, ClientTLS(pki["other_ca"]), "wrong-ca")


def test_a_plaintext_client_to_a_tls_server_is_refused(pki: dict[str, str]) -> None:
    with HandshakeServer(
        {"trainer": 1}, TOKEN, tls=ServerTLS(pki["server"], pki["server_key"])
    ) as srv:
        with pytest.raises(HandshakeError):
            _offer(srv.port, None, "plaintext")


def test_an_expired_server_certificate_is_refused(pki: dict[str, str]) -> None:
    with HandshakeServer(
        {"trainer": 1}, TOKEN, tls=ServerTLS(pki["expired"], pki["expired_key"])
    ) as srv:
        with pytest.raises(HandshakeError, match="TLS handshake"):
            _offer(srv.port, ClientTLS(pki["ca"]), "expired")


def test_mutual_tls_without_a_client_certificate_is_refused(pki: dict[str, str]) -> None:
    mtls = ServerTLS(pki["server"], pki["server_key"], client_ca=pki["ca"])
    with HandshakeServer({"trainer": 1}, TOKEN, tls=mtls) as srv:
        with pytest.raises(HandshakeError):
            _offer(srv.port, ClientTLS(pki["ca"]), "no-client-cert")


def test_plaintext_off_loopback_needs_insecure(pki: dict[str, str]) -> None:
    with pytest.raises(TLSConfigError, match="without TLS"):
        HandshakeServer({"trainer": 1}, TOKEN, host="0.0.0.0")
    HandshakeServer({"trainer": 1}, TOKEN, host="0.0.0.0", insecure=True)  # explicit: allowed
    HandshakeServer(
        {"trainer": 1}, TOKEN, host="0.0.0.0", tls=ServerTLS(pki["server"], pki["server_key"])
    )
    with pytest.raises(TLSConfigError, match="needs its key"):
        ClientTLS(pki["ca"], cert=pki["client"])


def test_cli_serves_tls_and_takes_the_token_from_the_environment(
    pki: dict[str, str], tmp_path: Path
) -> None:
    import os

    from isoexec.tools.cli import main

    # No token on the command line, ever: the flag does not exist.
    with pytest.raises(SystemExit):
        main(["handshake", "serve", "--token", TOKEN])
    env = {**os.environ, "ISOEXEC_HANDSHAKE_TOKEN": TOKEN}
    serve = subprocess.Popen(
        [sys.executable, "-m", "isoexec.tools.cli", "handshake", "serve", "--host", "0.0.0.0",
         "--tls-cert", pki["server"], "--tls-key", pki["server_key"], "--tls-client-ca", pki["ca"],
         "--expect", "trainer=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert "over mutual TLS" in line, line + (serve.stderr.read() if serve.poll() else "")
        port = int(line.split(":")[2].split(" ")[0])
        contract = tmp_path / "c.json"
        make_contract(1).save(contract)
        offer = subprocess.run(
            [sys.executable, "-m", "isoexec.tools.cli", "handshake", "offer", "--address",
             f"127.0.0.1:{port}", "--run-id", "cli", "--side", "trainer", "--tls-ca", pki["ca"],
             "--tls-cert", pki["client"], "--tls-key", pki["client_key"], "--timeout", "20",
             str(contract)],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert offer.returncode == 0 and offer.stdout.startswith("MATCH"), offer
    finally:
        serve.terminate()
        serve.wait(10)
    insecure = subprocess.run(
        [sys.executable, "-m", "isoexec.tools.cli", "handshake", "serve", "--host", "0.0.0.0"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert insecure.returncode == 2 and "without TLS" in insecure.stderr
