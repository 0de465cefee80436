"""Engine samples scored by a trainer in another process (torchrun): jobs and alignment.

`pair.sample_and_score` does this in-process; a `run_tp_jobs` trainer gets one job per
temperature (the sequences sampled at it) and its results are aligned back here.
"""

from __future__ import annotations

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
