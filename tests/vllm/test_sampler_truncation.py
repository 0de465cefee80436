"""Top-k / top-p / min-p under IsoExec, on vLLM's real `Sampler` code outside an engine.

The sampler masks the logits to the canonical kept set and lets vLLM draw with its own
truncation off: every sampled token is in the kept set, and the returned logprobs are the
trainer's (`isoexec.megatron.logprobs.truncated` + the canonical token logprobs), bit for bit.
Negative controls: vLLM's own sampler returns other bits on the same rows (its top-k keeps
ties), and a sampler that breaks ties by the higher id is caught by the same comparison.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata

from isoexec import ops
from isoexec.megatron.logprobs import truncated
from isoexec.ops import truncation as truncation_module
from isoexec.ops.truncation import Truncation
from isoexec.vllm.logprobs import IsoSampler

V = 512
# Per request: (temperature, truncation). Mixed in one batch, as vLLM batches requests.
REQUESTS = [
    (1.0, Truncation(top_k=20)),
    (0.7, Truncation(top_p=0.9)),
    (0.6, Truncation(top_k=20, top_p=0.95)),  # Qwen3's generation_config defaults
    (1.0, Truncation(min_p=0.05)),
    (0.8, Truncation(top_k=50, top_p=0.8, min_p=0.02)),
    (1.0, Truncation()),
    (0.0, Truncation(top_k=3)),  # greedy
]


def _min_p_processor(min_ps: list[float]) -> MinPLogitsProcessor:
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=len(min_ps)))
    proc = MinPLogitsProcessor(cfg, torch.device("cpu"), False)  # type: ignore[arg-type]
    added = [(i, SamplingParams(min_p=m), [], []) for i, m in enumerate(min_ps)]
    proc.update_state(BatchUpdate(batch_size=len(min_ps), removed=[], added=added, moved=[]))
    return proc


def _metadata(requests: list[tuple[float, Truncation]]) -> SamplingMetadata:
    n = len(requests)
    temps = [t for t, _ in requests]
    greedy = [t < 1e-5 for t in temps]
    k = [tr.top_k if 0 < tr.top_k < V else V for _, tr in requests]
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=torch.tensor([tr.top_p for _, tr in requests], dtype=torch.float32),
        top_k=torch.tensor(k, dtype=torch.int32),
        generators={},
        max_num_logprobs=0,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in requests],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors([_min_p_processor([tr.min_p for _, tr in requests])]),
    )


def _logits(rows: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3
    return torch.round(x * 2) / 2  # ties on a coarse grid: the tie rule matters


def _trainer_side(logits: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, list]:
    """What the trainer computes for each row: its logprob of the sampled token and its kept
    set, with the request's own settings (one row at a time, as it scores a sequence)."""
    lps, kept = [], []
    for i, (t, tr) in enumerate(REQUESTS):
        temp = t if t > 1e-5 else 1.0
        row = truncated(ops, logits[i : i + 1], temp, tr if tr.active else None)
        lps.append(ops.token_logprobs(row, sampled[i : i + 1], temperature=temp))
        kept.append(torch.isfinite(row[0]))
    return torch.cat(lps), kept


def _trainer_row(logits: torch.Tensor, t: float, tr: Truncation) -> torch.Tensor:
    """The trainer's full processed row for one position (its full-vocab scoring)."""
    temp = t if t > 1e-5 else 1.0
    return ops.log_softmax(
        truncated(ops, logits, temp, tr if tr.active else None), temperature=temp
    )


def _sample(sampler: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = sampler(logits.clone(), _metadata(REQUESTS))
    assert out.logprobs_tensors is not None
    return out.sampled_token_ids.reshape(-1).long(), out.logprobs_tensors.logprobs[:, 0]


@pytest.mark.parametrize("seed", range(6))
def test_logprobs_equal_the_trainers_and_every_token_is_in_the_kept_set(seed: int) -> None:
    sampler = IsoSampler(logprobs_mode="processed_logprobs")
    logits = _logits(len(REQUESTS), seed)
    sampled, got = _sample(sampler, logits)
    want, kept = _trainer_side(logits, sampled)
    assert torch.equal(got, want), (got - want).abs().max()
    for i, tok in enumerate(sampled.tolist()):
        assert kept[i][tok], (i, REQUESTS[i], tok)
    assert torch.isfinite(got).all()


def test_many_draws_never_leave_the_kept_set() -> None:
    sampler = IsoSampler(logprobs_mode="processed_logprobs")
    logits = _logits(len(REQUESTS), 99)
    _, kept = _trainer_side(logits, torch.zeros(len(REQUESTS), dtype=torch.long))
    seen: list[set[int]] = [set() for _ in REQUESTS]
    for _ in range(200):
        sampled, _ = _sample(sampler, logits)
        for i, tok in enumerate(sampled.tolist()):
            seen[i].add(tok)
    for i, s in enumerate(seen):
        allowed = set(kept[i].nonzero().reshape(-1).tolist())
        assert s <= allowed, (REQUESTS[i], s - allowed)
    assert len(seen[1]) > 1  # it does sample (top-p 0.9 at T=0.7 keeps many tokens)


def test_raw_logprobs_mode_returns_the_untruncated_row_at_t1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import isoexec.vllm.logprobs as engine_logprobs
    from isoexec.contract.options import IsoExecOptions

    raw = IsoExecOptions(logprobs_mode="raw_logprobs")
    monkeypatch.setattr(engine_logprobs, "engine_options", lambda: raw)
    sampler = IsoSampler(logprobs_mode="raw_logprobs")
    logits = _logits(len(REQUESTS), 5)
    sampled, got = _sample(sampler, logits)
    assert torch.equal(got, ops.token_logprobs(logits, sampled))


def test_negative_control_stock_sampler_gives_other_bits() -> None:
    from vllm.v1.sample.sampler import Sampler

    stock = Sampler(logprobs_mode="processed_logprobs")
    logits = _logits(len(REQUESTS), 0)
    sampled, got = _sample(stock, logits)
    want, _ = _trainer_side(logits, sampled)
    assert not torch.equal(got, want)


def test_negative_control_a_tie_break_by_higher_id_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Full processed rows (vLLM's max_logprobs=-1): with 30 tokens tied at the top and
    top-k=20, a sampler that keeps the higher ids of a tie returns rows the trainer's differ
    from, while the canonical sampler's are equal."""
    real_sort = torch.sort

    def higher_id_first(x: torch.Tensor, **kw: Any) -> Any:
        flipped = real_sort(x.flip(-1), **kw)
        return SimpleNamespace(indices=x.shape[-1] - 1 - flipped.indices)

    sampler = IsoSampler(logprobs_mode="processed_logprobs")
    logits = _logits(len(REQUESTS), 0)
    logits[0, :30] = 9.0
    want = torch.cat([_trainer_row(logits[i : i + 1], t, tr) for i, (t, tr) in enumerate(REQUESTS)])

    def rows() -> torch.Tensor:
        md = _metadata(REQUESTS)
        md.max_num_logprobs = -1
        out = sampler(logits.clone(), md)
        assert out.logprobs_tensors is not None
        return out.logprobs_tensors.logprobs

    assert torch.equal(rows(), want)
    monkeypatch.setattr(truncation_module.torch, "sort", higher_id_first)
    injected = rows()
    monkeypatch.undo()
    assert not torch.equal(injected[0], want[0])
