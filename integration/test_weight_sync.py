"""Weight sync through the handshake gate, and an engine restart that must re-handshake (on
request, or by itself at startup when given the handshake settings).

One optimizer step on the trainer → export (HF names) → fingerprint → the engine loads only
after MATCH and only if what arrived hashes to the trainer's fingerprint → both sides hold the
same weights (fingerprints equal) → sampling again is still bitwise equal to the trainer.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.handshake.served import ServedHandshake
from isoexec.handshake.server import HandshakeServer
from isoexec.megatron import export_hf_weights, save_hf_safetensors, train_step, trainer_contract
from isoexec.tools.pair import handshake, make_prompts, sample_and_score
from isoexec.vllm.engine_process import EngineConfig, EngineError, EngineProcess

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

TEMPS = [1.0, 0.7, 1.0, 0.7]


def test_weight_sync_restart_and_partial_transfer(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    trainer_factory: Callable[..., Any],
) -> None:
    model_dir = model_factory("tiny-dense", "float32")
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    trainer = trainer_factory(model_dir, "float32", fresh=True)
    contract = trainer_contract(trainer, hf, "float32")
    prompts = make_prompts(len(TEMPS), int(hf["vocab_size"]), seed=11)
    token = secrets.token_hex(16)

    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        engine = EngineProcess(EngineConfig(model=model_dir, isoexec=True, enforce_eager=True))
        try:
            tv, ev = handshake(contract, engine, "sync", server=server, token=token)
            assert tv.matched and ev["outcome"] == "MATCH"

            # One optimizer step on the trainer, then export in HF names.
            opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
            train_step(trainer, opt, [p[:40] for p in prompts])
            path = tmp_path / "step1.safetensors"
            save_hf_safetensors(trainer, path)
            sent = WeightFingerprint.of(export_hf_weights(trainer)).digest
            assert WeightFingerprint.of(load_file(str(path))).digest == sent

            # A partial transfer (one tensor missing) is refused; nothing is loaded.
            partial = load_file(str(path))
            partial.pop(next(iter(partial)))
            bad = tmp_path / "partial.safetensors"
            save_file(partial, str(bad))
            before = engine.call("weight_fingerprint")
            with pytest.raises(EngineError, match=r"1 tensor\(s\) missing.*nothing loaded"):
                engine.call("load_weights", str(bad), sent)
            assert engine.call("weight_fingerprint") == before != [sent]

            # The real transfer: loaded, and both sides now hold the same weights.
            assert engine.call("load_weights", str(path), sent) == [sent]
            train, eng = sample_and_score(engine, trainer, prompts, TEMPS, max_tokens=5)
            assert torch.equal(train, eng)
        finally:
            engine.close()

        # Engine restart: the new worker must offer its contract again before taking weights.
        restarted = EngineProcess(EngineConfig(model=model_dir, isoexec=True, enforce_eager=True))
        try:
            with pytest.raises(EngineError, match="no MATCH from the handshake"):
                restarted.call("load_weights", str(path), sent)
            (again,) = restarted.call("handshake", server.address, token, "sync")
            assert again["outcome"] == "MATCH", again
            assert server.may_receive_weights("sync", "engine", 0)
            assert restarted.call("load_weights", str(path), sent) == [sent]
            train, eng = sample_and_score(restarted, trainer, prompts, TEMPS, max_tokens=5)
            assert torch.equal(train, eng)
        finally:
            restarted.close()

        # A restart given the handshake settings (as `isoexec engine serve --handshake-*` and an
        # embedded AsyncLLM get them) offers by itself as soon as it has loaded the checkpoint:
        # it is cleared with no call from us, and takes the weights.
        token_file = tmp_path / "token"
        token_file.write_text(token)
        settings = ServedHandshake(server.address, str(token_file), "sync")
        served = EngineProcess(EngineConfig(model=model_dir, isoexec=True, enforce_eager=True,
                                            handshake=settings))  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while (status := served.call("collective_rpc", "isoexec_gate_status")[0])[
                "last_verdict"
            ] is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert status["last_verdict"] == "MATCH" and status["cleared"], status
            assert served.call("load_weights", str(path), sent) == [sent]
        finally:
            served.close()
