"""A weight push landing while 32 streams generate, on vLLM's `AsyncLLM` (the engine async RL
frameworks embed; `_async_rollouts.py`, in its own process group, killed whatever happens).

Through `WeightVersions` (the push the served route runs too): every sequence reports one
weights version and fingerprint, the 32 in flight finish under the old weights, the requests
sent during the push wait and run under the new ones, and every sampled token's logprob is
bitwise the trainer's scoring under the weights its version names. Negative control: the same
push through a bare `collective_rpc` (no drain, no pause) while 32 streams generate leaves
sequences that match neither the old weights nor the new.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _served import stop_session

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

SCRIPT = Path(__file__).with_name("_async_rollouts.py")
STREAMS = 32
LATE = 8
MAX_TOKENS = 24


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(6, 20))] for _ in range(n)]


def _run(spec: dict[str, Any], tmp: Path, offer: Callable[[], Any]) -> dict[str, Any]:
    (tmp / "spec.json").write_text(json.dumps(spec))
    log_path = tmp / "rollouts.log"
    cmd = [sys.executable, str(SCRIPT), str(tmp / "spec.json"), str(tmp / "out.json")]
    with log_path.open("wb") as log:
        env = {**os.environ, "ISOEXEC": "1"}
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        offer()
        assert proc.wait(timeout=900) == 0, log_path.read_text()[-4000:]
    finally:
        stop_session(proc)
    return json.loads((tmp / "out.json").read_text())


def _bitwise(trainer: Any, stream: dict[str, Any]) -> bool:
    from isoexec.megatron.scoring import score

    ids = stream["ids"]
    (lp,) = score(trainer, [stream["prompt"] + ids], temperature=1.0)
    return torch.equal(lp[-len(ids) :].float(), torch.tensor(stream["logprobs"]))


def test_a_push_mid_generation_never_mixes_versions(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    trainer_factory: Callable[..., Any],
) -> None:
    from safetensors.torch import save_file

    from isoexec.contract.fingerprint import WeightFingerprint
    from isoexec.handshake.client import HandshakeClient
    from isoexec.handshake.server import HandshakeServer
    from isoexec.megatron import export_hf_weights, train_step, trainer_contract

    model = model_factory("tiny-dense", "float32")
    hf = json.loads((Path(model) / "config.json").read_text())
    vocab = int(hf["vocab_size"])
    prompts = _prompts(2 * STREAMS + LATE, vocab, seed=21)
    a, late, b = prompts[:STREAMS], prompts[STREAMS : STREAMS + LATE], prompts[STREAMS + LATE :]
    trainer = trainer_factory(model, "float32", isoexec=True, fresh=True)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    pushes, held = [], []  # (file, fingerprint) and the trainer's parameters, per version 1, 2
    for k in (1, 2):
        train_step(trainer, opt, prompts[:6])
        weights = dict(export_hf_weights(trainer))
        save_file({n: t.contiguous() for n, t in weights.items()}, tmp_path / f"w{k}.safetensors")
        pushes.append((str(tmp_path / f"w{k}.safetensors"), WeightFingerprint.of(weights).digest))
        held.append({n: p.detach().clone() for n, p in trainer.named_parameters()})
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as hs:
        settings = {"address": hs.address, "token_file": str(tmp_path / "token"),
                    "run_id": "async-push"}  # fmt: skip
        spec = {"model": model, "handshake": settings, "prompts_a": a, "late": late,
                "prompts_b": b, "max_tokens": MAX_TOKENS, "pushes": pushes}  # fmt: skip

        def offer() -> None:
            with HandshakeClient(hs.address, token, timeout_s=300) as client:
                verdict = client.offer("async-push", "trainer", 0,
                                       trainer_contract(trainer, hf, "float32"))  # fmt: skip
            assert verdict.matched, verdict

        out = _run(spec, tmp_path, offer)

    def holding(k: int) -> Any:  # the trainer with the weights of version k
        if k == 0:
            return trainer_factory(model, "float32", isoexec=True)  # the checkpoint's
        with torch.no_grad():
            for n, p in trainer.named_parameters():
                p.copy_(held[k - 1][n])
        return trainer

    # Protected: 32 in flight when the push began finish under version 0; the late ones wait
    # and run under version 1; each is bitwise under the weights its version names.
    first, waited = out["a"][:STREAMS], out["a"][STREAMS:]
    assert all(0 < s["before_push"] < MAX_TOKENS for s in first), [s["before_push"] for s in first]
    assert all(len(s["ids"]) == MAX_TOKENS for s in out["a"])
    assert {(s["version"], s["fingerprint"]) for s in first} == {(0, None)}
    assert {(s["version"], s["fingerprint"]) for s in waited} == {(1, pushes[0][1])}
    assert out["fingerprint_after_a"] == pushes[0][1]
    v0, v1 = holding(0), holding(1)
    assert all(_bitwise(v0, s) for s in first)
    assert all(_bitwise(v1, s) for s in waited)
    assert not any(_bitwise(v1, s) for s in first[:4])  # the versions' weights do differ

    # Negative control: the bare load lands mid-sequence; some sequences are neither's.
    unprotected = out["b"]
    assert all(0 < s["before_push"] < MAX_TOKENS for s in unprotected)
    neither = [s for s in unprotected if not (_bitwise(holding(1), s) or _bitwise(holding(2), s))]
    print(f"bare collective_rpc push: {len(neither)}/{STREAMS} sequences match neither version")
    assert neither
