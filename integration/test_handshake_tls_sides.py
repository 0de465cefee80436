"""The real sides over mutual TLS: every engine worker (vLLM) and the trainer offer their
contracts to a TLS service that requires client certificates, get MATCH, and the weight gate
asks the same service over TLS before loading. A worker given no client certificate is refused
at the TLS layer, before any contract is read."""

from __future__ import annotations

import json
import secrets
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "_support"))
from pki import make_pki

from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.handshake.client import HandshakeClient
from isoexec.handshake.server import HandshakeServer
from isoexec.handshake.tls import ClientTLS, ServerTLS
from isoexec.megatron import export_hf_weights, trainer_contract
from isoexec.vllm.engine_process import EngineError

pytestmark = [pytest.mark.engine, pytest.mark.trainer]


def test_both_sides_over_mutual_tls_then_gated_weight_sync(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    client = ClientTLS(pki["ca"], pki["client"], pki["client_key"])
    model = model_factory("tiny-dense", "float32")
    hf = json.loads((Path(model) / "config.json").read_text())
    trainer = trainer_factory(model, "float32")
    engine = engine_pool(
        model=model, dtype="float32", isoexec=True, seed=7, enforce_eager=True
    )  # its own engine
    token = secrets.token_hex(16)
    mtls = ServerTLS(pki["server"], pki["server_key"], client_ca=pki["ca"])
    with HandshakeServer({"trainer": 1, "engine": 1}, token, host="127.0.0.1", tls=mtls) as srv:
        # A worker without a client certificate: refused by TLS, nothing offered.
        with pytest.raises(EngineError, match="HandshakeError"):
            engine.call("handshake", srv.address, token, "no-cert", {"ca": pki["ca"]})
        got: dict[str, Any] = {}

        def engine_offers() -> None:
            got["engine"] = engine.call("handshake", srv.address, token, "tls", client.to_dict())

        t = threading.Thread(target=engine_offers)
        t.start()
        with HandshakeClient(srv.address, token, tls=client) as c:
            verdict = c.offer("tls", "trainer", 0, trainer_contract(trainer, hf, "float32"))
        t.join(120)
        assert verdict.matched and [v["outcome"] for v in got["engine"]] == ["MATCH"]
        # The gate asks the TLS service; the weights (unchanged) load and fingerprint.
        weights = dict(export_hf_weights(trainer))
        path = tmp_path / "w.safetensors"
        save_file(weights, str(path))
        sent = WeightFingerprint.of(weights).digest
        assert engine.call("load_weights", str(path), sent) == [sent]
