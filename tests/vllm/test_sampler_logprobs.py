"""IsoExec's sampler returns the canonical logprobs and has vLLM compute no logprobs of its own
(which it would throw away): one full-vocab log-softmax per step, not two. Mixed temperatures
go row group by row group; one temperature goes in one call: the same bits (log-softmax is
row-invariant). Run on vLLM's real `Sampler` code, outside an engine."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

from isoexec import ops
from isoexec.vllm.logprobs import IsoSampler, canonical_logprobs

V = 4096


def _metadata(temps: list[float]) -> SamplingMetadata:
    t = torch.tensor(temps, dtype=torch.float32)
    greedy = [x < 1e-5 for x in temps]
    return SamplingMetadata(
        temperature=t,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=0,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(len(temps)),
        presence_penalties=torch.zeros(len(temps)),
        repetition_penalties=torch.ones(len(temps)),
        output_token_ids=[[] for _ in temps],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(rows)) * 4


@pytest.mark.parametrize("temps", [[1.0] * 6, [0.7] * 5, [0.0] * 4, [1.0, 0.7, 0.0, 0.7, 1.0]])
def test_canonical_logprobs_is_each_rows_log_softmax_at_its_temperature(
    temps: list[float],
) -> None:
    logits = _logits(len(temps))
    got = canonical_logprobs(logits, torch.tensor(temps))
    for i, t in enumerate(temps):
        row = ops.log_softmax(logits[i : i + 1], temperature=t if t > 1e-5 else 1.0)
        assert torch.equal(got[i : i + 1], row), (i, t)


def test_negative_control_a_different_temperature_gives_other_bits() -> None:
    logits = _logits(3)
    assert not torch.equal(
        canonical_logprobs(logits, torch.tensor([0.7] * 3)),
        canonical_logprobs(logits, torch.tensor([0.7, 0.7, 0.71])),
    )


def _count_log_softmax(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count full-vocab log-softmaxes: vLLM's (`Tensor.log_softmax`) and the canonical op's."""
    calls = [0, 0]
    tensor_ls = torch.Tensor.log_softmax
    torch_ls = torch.log_softmax

    def vllm_side(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        calls[0] += 1
        return tensor_ls(self, *a, **k)

    def canonical_side(*a: Any, **k: Any) -> torch.Tensor:
        calls[1] += 1
        return torch_ls(*a, **k)

    monkeypatch.setattr(torch.Tensor, "log_softmax", vllm_side)
    monkeypatch.setattr(torch, "log_softmax", canonical_side)
    return calls


@pytest.mark.parametrize("temps", [[1.0] * 4, [0.0] * 4, [1.0, 0.0, 0.7, 1.0]])
def test_sampler_returns_canonical_logprobs_and_vllm_computes_none(
    temps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = IsoSampler(logprobs_mode="processed_logprobs")
    logits = _logits(len(temps))
    want = canonical_logprobs(logits.clone(), torch.tensor(temps))
    calls = _count_log_softmax(monkeypatch)
    out = sampler(logits.clone(), _metadata(temps))
    groups = len({t if t > 1e-5 else 1.0 for t in temps})
    assert calls == [0, groups]
    lp = out.logprobs_tensors
    assert lp is not None
    sampled = out.sampled_token_ids.reshape(-1).long()
    assert torch.equal(lp.logprobs[:, 0], want.gather(-1, sampled[:, None]).squeeze(-1))


def test_negative_control_stock_sampler_computes_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")
    calls = _count_log_softmax(monkeypatch)
    sampler(_logits(4), _metadata([1.0] * 4))
    assert calls[0] + calls[1] == 1
