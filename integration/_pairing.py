"""Engine samples scored by a trainer in another process (torchrun): jobs and alignment; and
`isoexec pair` run as a user runs it (`run_pair_cli`).

`pair.sample_and_score` does this in-process; a `run_tp_jobs` trainer gets one job per
temperature (the sequences sampled at it) and its results are aligned back here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import torch


def scoring_jobs(sampled: list[Any], temps: list[float], **job: Any) -> list[dict[str, Any]]:
    """One trainer job per temperature, scoring the prompt + completion it sampled."""
    return [
        {
            **job,
            "temperature": temp,
            "seqs": [
                c.prompt_token_ids + c.token_ids
                for c, t in zip(sampled, temps, strict=True)
                if t == temp
            ],
        }
        for temp in sorted(set(temps))
    ]


def aligned_logprobs(
    sampled: list[Any], temps: list[float], jobs: list[dict[str, Any]], results: list[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer, engine) fp32 logprobs of every sampled token, in the same order."""
    train, eng = [], []
    for job, res in zip(jobs, results, strict=True):
        group = [c for c, t in zip(sampled, temps, strict=True) if t == job["temperature"]]
        for c, lp in zip(group, res["logprobs"], strict=True):
            train.append(lp[-len(c.token_ids) :].float())
            eng.append(torch.tensor(c.logprobs, dtype=torch.float32))
    return torch.cat(train), torch.cat(eng)


def assert_tp_invariant_match_and_bitwise(
    mine: list[tuple[dict[str, Any], Any]],
    engine: Any,
    sampled: list[Any],
    temps: list[float],
    run_id: str,
) -> None:
    """The trainer jobs' contract (every site TP-invariant) MATCHes the engine at the
    handshake, and every sampled token's logprob is bitwise the engine's."""
    from isoexec.contract.contract import Contract
    from isoexec.tools.pair import handshake

    contract = Contract.from_bytes(mine[0][1]["contract"])
    assert {s.tp for s in contract.sites} == {"invariant"}
    trainer_verdict, engine_verdict = handshake(contract, engine, run_id=run_id)
    assert trainer_verdict.matched and engine_verdict["outcome"] == "MATCH", trainer_verdict
    jobs, results = [j for j, _ in mine], [r for _, r in mine]
    t, e = aligned_logprobs(sampled, temps, jobs, results)
    assert t.numel() == sum(len(c.token_ids) for c in sampled) > 0
    assert torch.equal(t, e), (t - e).abs().max()


def run_pair_cli(args: list[str], timeout_s: int = 600) -> subprocess.CompletedProcess[str]:
    """`python -m isoexec.tools.cli pair ...` in its own session; the whole group (engines
    included) is killed if it overruns or the test is interrupted."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "isoexec.tools.cli", "pair", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
