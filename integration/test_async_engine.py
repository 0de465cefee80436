"""AsyncLLM, the engine RL frameworks embed: IsoExec installed by `ISOEXEC=1`, vLLM's default
compiled mode, every worker's contract offered through `collective_rpc` (MATCH with the
trainer), concurrent requests with n=2 at temperatures 1.0 and 0.7, and every sampled token's
logprob bitwise the trainer's. The AsyncLLM runs in its own process group, killed whatever
happens (`_async_engine_job.py`)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from isoexec.contract.handshake.client import HandshakeClient
from isoexec.contract.handshake.server import HandshakeServer
from isoexec.contract.pair import make_prompts
from isoexec.megatron import trainer_contract
from isoexec.megatron.scoring import score

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

JOB = Path(__file__).with_name("_async_engine_job.py")
TEMPS = [1.0, 0.7, 1.0, 0.7]


def _run_job(job: dict[str, Any], tmp: Path) -> subprocess.Popen[bytes]:
    (tmp / "job.json").write_text(json.dumps(job))
    log = (tmp / "async.log").open("wb")
    env = {**os.environ, "ISOEXEC": "1"}
    cmd = [sys.executable, str(JOB), str(tmp / "job.json"), str(tmp / "out.json")]
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def test_async_llm_matches_and_is_bitwise(
    tmp_path: Path, model_factory: Callable[[str, str], str], trainer_factory: Callable[..., Any]
) -> None:
    model = model_factory("tiny-moe", "float32")
    hf = json.loads((Path(model) / "config.json").read_text())
    prompts = make_prompts(len(TEMPS), int(hf["vocab_size"]), seed=9)
    trainer = trainer_factory(model, "float32")
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        hs = {"address": server.address, "token_file": str(tmp_path / "token"), "run_id": "async"}
        job = {"model": model, "dtype": "float32", "handshake": hs, "prompts": prompts,
               "temps": TEMPS, "n": 2, "max_tokens": 6}  # fmt: skip
        proc = _run_job(job, tmp_path)
        try:
            with HandshakeClient(server.address, token) as c:
                verdict = c.offer("async", "trainer", 0, trainer_contract(trainer, hf, "float32"))
            assert proc.wait(timeout=600) == 0, (tmp_path / "async.log").read_text()[-4000:]
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
            proc.wait(30)
    out = json.loads((tmp_path / "out.json").read_text())
    assert verdict.matched and [v["outcome"] for v in out["verdicts"]] == ["MATCH"]
    train, eng = [], []
    for prompt, temp, samples in zip(prompts, TEMPS, out["samples"], strict=True):
        assert len(samples) == 2
        seqs = [prompt + ids for ids, _ in samples]
        for lp, (ids, lps) in zip(score(trainer, seqs, temperature=temp), samples, strict=True):
            train.append(lp[-len(ids) :].float())
            eng.append(torch.tensor(lps, dtype=torch.float32))
    t, e = torch.cat(train), torch.cat(eng)
    assert t.numel() == len(prompts) * 2 * 6
    assert torch.equal(t, e), (t - e).abs().max()
