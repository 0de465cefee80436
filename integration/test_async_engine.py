"""AsyncLLM, the engine RL frameworks embed: IsoExec installed by `ISOEXEC=1`, vLLM's default
compiled mode, the handshake settings in vLLM's `additional_config`, so every worker offers its
contract as soon as it has loaded the checkpoint (MATCH with the trainer); concurrent requests
with n=2 at temperatures 1.0 and 0.7, and every sampled token's logprob bitwise the trainer's.
The AsyncLLM runs in its own process group, killed whatever happens (`_async_engine_job.py`)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _served import stop_session

from isoexec.handshake.server import HandshakeServer
from isoexec.tools.pair import make_prompts

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
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    """The trainer side runs on torchrun (its own processes, like the engine): one job offers
    its contract while the AsyncLLM offers its workers', a second scores what was sampled."""
    model = model_factory("tiny-moe", "float32")
    hf = json.loads((Path(model) / "config.json").read_text())
    prompts = make_prompts(len(TEMPS), int(hf["vocab_size"]), seed=9)
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    trainer = {"model": model, "dtype": "float32", "tp": 1, "isoexec": True}
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        hs = {"address": server.address, "token_file": str(tmp_path / "token"), "run_id": "async"}
        job = {"model": model, "dtype": "float32", "handshake": hs, "prompts": prompts,
               "temps": TEMPS, "n": 2, "max_tokens": 6}  # fmt: skip
        proc = _run_job(job, tmp_path)
        try:
            (offered,) = run_tp_jobs([{**trainer, "seqs": [[1, 2, 3]], "handshake": hs}], [],
                                     nproc=1)  # fmt: skip
            assert proc.wait(timeout=600) == 0, (tmp_path / "async.log").read_text()[-4000:]
        finally:
            stop_session(proc)
    out = json.loads((tmp_path / "out.json").read_text())
    assert offered["verdict"]["outcome"] == "MATCH"
    assert [v["outcome"] for v in out["verdicts"]] == ["MATCH"]
    levels = sorted(set(TEMPS))
    groups = {t: [] for t in levels}  # (seq, sampled ids, engine logprobs) per temperature
    for prompt, temp, samples in zip(prompts, TEMPS, out["samples"], strict=True):
        assert len(samples) == 2
        groups[temp] += [(prompt + ids, ids, lps) for ids, lps in samples]
    jobs = [{**trainer, "temperature": t, "seqs": [g[0] for g in groups[t]]} for t in levels]
    train, eng = [], []
    for t, res in zip(levels, run_tp_jobs(jobs, [], nproc=1), strict=True):
        for lp, (_, ids, lps) in zip(res["logprobs"], groups[t], strict=True):
            train.append(lp[-len(ids) :].float())
            eng.append(torch.tensor(lps, dtype=torch.float32))
    a, b = torch.cat(train), torch.cat(eng)
    assert a.numel() == len(prompts) * 2 * 6
    assert torch.equal(a, b), (a - b).abs().max()
