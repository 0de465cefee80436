"""`isoexec.handshake.served`: the served engine's handshake settings are checked loudly, and
the push client reports a refusal with the server's reason."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from isoexec.handshake.served import (
    FINGERPRINT_HEADER,
    ServedHandshake,
    ServedHandshakeError,
    WeightPushError,
    push_weights,
)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"address": "h:1", "token_file": "/t"}, r"lack \['run_id'\]"),
        ({"address": "h:1", "token_file": "/t", "run_id": "r", "port": 1}, "unknown"),
        ({"address": "", "token_file": "/t", "run_id": "r"}, "address must be"),
        ({"address": "h:1", "token_file": "/t", "run_id": "r", "tls_cert": "c"}, "needs its key"),
    ],
)
def test_malformed_settings_are_refused(mapping: dict, message: str) -> None:
    with pytest.raises(ServedHandshakeError, match=message):
        ServedHandshake.from_mapping(mapping)


def test_token_file_missing_or_empty_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServedHandshakeError, match="No such file"):
        ServedHandshake("h:1", str(tmp_path / "none"), "r").token()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ServedHandshakeError, match="is empty"):
        ServedHandshake("h:1", str(tmp_path / "empty"), "r").token()


def test_push_sends_bytes_fingerprint_and_token_and_reports_a_refusal() -> None:
    from safetensors.torch import load

    from isoexec.contract.fingerprint import WeightFingerprint

    seen: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.update(auth=self.headers["Authorization"], fp=self.headers[FINGERPRINT_HEADER],
                        tensors=load(body))  # fmt: skip
            ok = self.headers["Authorization"] == "Bearer good"
            reply = {"fingerprints": [seen["fp"]]} if ok else {"error": "missing or wrong token"}
            data = json.dumps(reply).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    tensors = {"a.weight": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    try:
        fp = WeightFingerprint.of(tensors).digest
        assert push_weights(url, "good", tensors) == [fp]
        assert seen["auth"] == "Bearer good" and seen["fp"] == fp
        assert all(torch.equal(seen["tensors"][k], v) for k, v in tensors.items())
        with pytest.raises(WeightPushError, match="HTTP 401: missing or wrong token"):
            push_weights(url, "bad", tensors)
    finally:
        server.shutdown()


def test_sampling_record_round_trips_and_refuses_what_is_missing_or_malformed() -> None:
    from isoexec.handshake.served import SamplingRecord, SamplingRecordError

    record = SamplingRecord(0.6, "processed_logprobs", 2)
    assert SamplingRecord.from_header(record.to_header()) == record
    truncated = SamplingRecord(0.6, "processed_logprobs", 2, None, 20, 0.95, 0.05, "ab" * 32)
    assert SamplingRecord.from_header(truncated.to_header()) == truncated
    adjusted = SamplingRecord(1.0, "processed_logprobs", 0, None, 0, 1.0, 0.0, None, 1.05, 0.5,
                              -0.25, ((3, 2.0), (9, -100.0)), (1, 3, 9))  # fmt: skip
    assert SamplingRecord.from_header(adjusted.to_header()) == adjusted
    assert adjusted.penalties().logit_bias == ((3, 2.0), (9, -100.0))
    full = ('"weights_version": 0, "adapter": null, "top_p": 1.0, "min_p": 0.0, '
            '"weights_fingerprint": null, "repetition_penalty": 1.0, "frequency_penalty": 0.0, '
            '"presence_penalty": 0.0, "logit_bias": [], "allowed_token_ids": null')  # fmt: skip
    good = '{"temperature": 1, "logprobs_mode": "x", "top_k": 0, ' + full + "}"
    assert SamplingRecord.from_header(good).penalties().active is False  # the control
    bad_headers = [
        None, "", "{", "[]", '{"temperature": 1.0}',
        '{"temperature": "hot", "logprobs_mode": "x", "weights_version": 0}',
        '{"temperature": 1, "logprobs_mode": "x", "weights_version": 0, "top_k": 5}',
        '{"temperature": 1, "logprobs_mode": "x", ' + full + ', "top_k": 2.5}',
        '{"temperature": 1, "logprobs_mode": "x", ' + full + ', "top_k": true}',
        '{"temperature": 1, "logprobs_mode": "x", ' + full + '}',
        '{"temperature": 1, "logprobs_mode": "x", "top_k": 0, '
        + full.replace('"weights_fingerprint": null', '"weights_fingerprint": 7') + '}',
        good.replace('"repetition_penalty": 1.0', '"repetition_penalty": 0.0'),
        good.replace('"logit_bias": []', '"logit_bias": [[9, 1.0], [3, 1.0]]'),  # unsorted
        good.replace('"logit_bias": []', '"logit_bias": [[-1, 1.0]]'),
        good.replace('"logit_bias": []', '"logit_bias": [[2.5, 1.0]]'),
        good.replace('"logit_bias": []', '"logit_bias": {"3": 1.0}'),
        good.replace('"allowed_token_ids": null', '"allowed_token_ids": []'),
        good.replace('"allowed_token_ids": null', '"allowed_token_ids": "all"'),
        good.replace('"presence_penalty": 0.0', '"presence_penalty": NaN'),
    ]  # fmt: skip
    for bad in bad_headers:
        with pytest.raises(SamplingRecordError):
            SamplingRecord.from_header(bad)
