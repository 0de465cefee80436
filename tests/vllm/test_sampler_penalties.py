"""Penalties, logit bias and allowed tokens under IsoExec, on vLLM's real `Sampler` code outside
an engine.

The sampler applies the canonical adjustments (`isoexec.ops.penalties`) from the history vLLM
keeps per request (prompt ids padded with V, output ids so far) and the state of vLLM's own
logit-bias processor; the trainer applies the same function to the history it rebuilds from the
scored sequence (`rows_for_sequences`). Their logprobs of every sampled token are equal bit for
bit. Negative controls: the trainer without the adjustments gives other numbers (they do change
the distribution), and an engine that counts the history one token short is caught.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata

import isoexec.vllm.logprobs as engine_logprobs
from isoexec import ops
from isoexec.megatron.logprobs import truncated
from isoexec.ops.penalties import Penalties, PenaltiesError, batch_history, rows_for_sequences
from isoexec.ops.truncation import Truncation
from isoexec.vllm.logprobs import IsoSampler

V = 256
# Per request: temperature, truncation, adjustments. Mixed in one batch, as vLLM batches them.
REQUESTS = [
    (1.0, Truncation(), Penalties.of(repetition_penalty=1.3)),
    (0.7, Truncation(top_p=0.9), Penalties.of(frequency_penalty=0.5, presence_penalty=0.25)),
    (0.6, Truncation(top_k=20, top_p=0.95), Penalties.of(repetition_penalty=1.05)),  # Qwen3
    (1.0, Truncation(), Penalties.of(logit_bias={3: 5.0, 17: -2.5, 200: 0.125})),
    (0.9, Truncation(min_p=0.02), Penalties.of(allowed_token_ids=list(range(0, V, 3)))),
    (1.0, Truncation(), Penalties()),  # none: left alone in a batch that has them
    (0.0, Truncation(), Penalties.of(repetition_penalty=1.5, frequency_penalty=-0.5)),  # greedy
    (0.8, Truncation(top_k=50), Penalties.of(1.2, 0.3, 0.1, {5: 1.0}, list(range(100)))),
]


def _histories(seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output so far) per request, with repeats so that counts exceed 1, drawn from
    the row's likeliest tokens (a penalty on tokens outside a nucleus changes nothing)."""
    rng = random.Random(seed)
    top = _logits(seed).topk(6, dim=-1).indices.tolist()
    out = []
    for i, _ in enumerate(REQUESTS):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))] + [top[i][5]]
        pool = top[i][:4]
        output = [rng.choice(pool) for _ in range(i % 4 * 3)]  # 0, 3, 6 or 9 tokens
        out.append((prompt, output))
    return out


def _processors(n: int) -> LogitsProcessors:
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=n))
    min_p = MinPLogitsProcessor(cfg, torch.device("cpu"), False)  # type: ignore[arg-type]
    bias = LogitBiasLogitsProcessor(cfg, torch.device("cpu"), False)
    added = [
        (i, SamplingParams(min_p=tr.min_p, logit_bias=dict(p.logit_bias) or None), [], [])
        for i, (_, tr, p) in enumerate(REQUESTS)
    ]
    for proc in (min_p, bias):
        proc.update_state(BatchUpdate(batch_size=n, removed=[], added=added, moved=[]))
    return LogitsProcessors([min_p, bias])


def _metadata(histories: list[tuple[list[int], list[int]]]) -> SamplingMetadata:
    n = len(REQUESTS)
    temps = [t for t, _, _ in REQUESTS]
    greedy = [t < 1e-5 for t in temps]
    width = max(len(p) for p, _ in histories)
    prompts = torch.full((n, width), V, dtype=torch.int64)
    for i, (p, _) in enumerate(histories):
        prompts[i, : len(p)] = torch.tensor(p)
    allowed = torch.zeros((n, V), dtype=torch.bool)
    for i, (_, _, pen) in enumerate(REQUESTS):
        if pen.allowed_token_ids is not None:
            allowed[i] = True
            allowed[i, list(pen.allowed_token_ids)] = False  # vLLM's mask: True is masked
    pens = [p for _, _, p in REQUESTS]
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=torch.tensor([tr.top_p for _, tr, _ in REQUESTS], dtype=torch.float32),
        top_k=torch.tensor([tr.top_k if tr.top_k > 0 else V for _, tr, _ in REQUESTS]),
        generators={},
        max_num_logprobs=0,
        no_penalties=False,
        prompt_token_ids=prompts,
        frequency_penalties=torch.tensor([p.frequency_penalty for p in pens]),
        presence_penalties=torch.tensor([p.presence_penalty for p in pens]),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in pens]),
        output_token_ids=[o for _, o in histories],
        allowed_token_ids_mask=allowed,
        bad_words_token_ids={},
        logitsprocs=_processors(n),
    )


def _logits(seed: int) -> torch.Tensor:
    x = torch.randn(len(REQUESTS), V, generator=torch.Generator().manual_seed(seed)) * 3
    return torch.round(x * 4) / 4


def _engine(logits: torch.Tensor, histories: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out = IsoSampler(logprobs_mode="processed_logprobs")(logits.clone(), _metadata(histories))
    assert out.logprobs_tensors is not None
    return out.sampled_token_ids.reshape(-1).long(), out.logprobs_tensors.logprobs[:, 0]


def _trainer(
    logits: torch.Tensor, histories: Any, sampled: torch.Tensor, adjust: bool = True
) -> torch.Tensor:
    """The trainer's logprob of each sampled token: the request's whole sequence (prompt,
    output so far, the sampled token), its rows' adjustments from that sequence alone, the
    engine's logits row at the sampling position."""
    got = []
    for i, ((t, tr, pen), (prompt, output)) in enumerate(zip(REQUESTS, histories, strict=True)):
        seq = torch.tensor([*prompt, *output, int(sampled[i])])
        rows = torch.randn(seq.numel() - 1, V)  # earlier positions' rows: not compared
        rows[-1] = logits[i]
        adj = rows_for_sequences(pen, [seq], [len(prompt)], V, "cpu") if adjust else None
        temp = t if t > 1e-5 else 1.0
        cut = tr if tr.active and t > 1e-5 else None
        row = truncated(ops, rows, temp, cut, adj)[-1:]
        got.append(ops.token_logprobs(row, seq[-1:], temperature=temp))
    return torch.cat(got)


@pytest.mark.parametrize("seed", range(5))
def test_sampled_logprobs_equal_the_trainers_with_every_adjustment(seed: int) -> None:
    histories = _histories(seed)
    logits = _logits(seed)
    sampled, got = _engine(logits, histories)
    want = _trainer(logits, histories, sampled)
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.isfinite(got).all()
    for i, (_, _, pen) in enumerate(REQUESTS):
        if pen.allowed_token_ids is not None:
            assert int(sampled[i]) in pen.allowed_token_ids


def test_negative_control_the_adjustments_change_the_logprobs() -> None:
    """Scored without the adjustments, every request that has one differs."""
    differs = torch.zeros(len(REQUESTS), dtype=torch.bool)
    for seed in range(2):
        histories = _histories(seed)
        logits = _logits(seed)
        sampled, got = _engine(logits, histories)
        row = got != _trainer(logits, histories, sampled, adjust=False)
        assert not bool(row[5])  # the request without adjustments: left alone, bit for bit
        differs |= row
    assert differs.tolist() == [True] * 5 + [False] + [True] * 2, differs


def test_negative_control_a_history_one_token_short_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    histories = _histories(1)
    logits = _logits(1)
    sampled, got = _engine(logits, histories)
    assert torch.equal(got, _trainer(logits, histories, sampled))

    def short(prompt_ids: torch.Tensor, outputs: Any, vocab: int) -> Any:
        return batch_history(prompt_ids, [o[:-1] for o in outputs], vocab)

    monkeypatch.setattr(engine_logprobs, "batch_history", short)
    sampled, injected = _engine(logits, histories)
    assert not torch.equal(injected, _trainer(logits, histories, sampled))


def test_the_histories_agree_row_by_row() -> None:
    """`sequence_history` (trainer, every position of one sequence) against `batch_history`
    (engine, one row per request) at each position of a sequence with repeats."""
    seq = torch.tensor([4, 9, 4, 7, 7, 7, 2, 9, 4])
    pen = Penalties.of(repetition_penalty=1.2, frequency_penalty=0.1)
    adj = rows_for_sequences(pen, [seq], [3], 12, "cpu")
    assert adj.seen is not None and adj.counts is not None
    for row in range(seq.numel() - 1):
        outputs = seq[3 : row + 1].tolist() if row >= 3 else []
        seen, counts = batch_history(seq[None, :3], [outputs], 12)
        assert torch.equal(adj.seen[row], seen[0]) and torch.equal(adj.counts[row], counts[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must be"),
        ({"logit_bias": {2: float("inf")}}, r"logit_bias\[2\] must be a finite"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PenaltiesError, match=match):
        Penalties.of(**kwargs)


def test_penalties_without_prompt_lengths_are_refused() -> None:
    with pytest.raises(PenaltiesError, match="give each sequence's prompt length"):
        rows_for_sequences(Penalties.of(presence_penalty=0.5), [torch.arange(5)], None, V, "cpu")
    with pytest.raises(PenaltiesError, match="outside the vocabulary"):
        rows_for_sequences(Penalties.of(logit_bias={V: 1.0}), [torch.arange(5)], None, V, "cpu")
