"""Speculative decoding (vLLM's n-gram proposer) under IsoExec, on real engines and a real
Megatron trainer.

The engine verifies k=3 drafts per step (also k=1 and k=5) in one forward over k+1 positions,
and vLLM's rejection rule decides which survive; IsoExec's rejection sampler
(`isoexec.vllm.spec_decode`) gives it canonical rows. Checked here: drafts are accepted (the
path is exercised, not skipped), every returned logprob (accepted, recovered and bonus tokens)
is bitwise the trainer's scoring of the finished sequence with the request's settings, and a
greedy request's tokens and bits are the same with and without speculation. Negative
controls: the same completions scored without their settings differ, and an engine whose draft
rows forget the drafts before them (a changed penalty history) is caught. The contract: the
speculating engine declares "invariant" and MATCHes its trainer; behind vLLM's own rejection
sampler it declares "ngram/3" and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from isoexec.ops.penalties import Penalties
from isoexec.ops.truncation import Truncation
from isoexec.tools.pair_steps import sample, score_completions

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

NGRAM = (("method", "ngram"), ("num_speculative_tokens", 3), ("prompt_lookup_max", 3),
         ("prompt_lookup_min", 1))  # fmt: skip
TOKENS = 24
# Repetitive prompts, so the n-gram proposer has something to propose.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9, 10, 9],
           [1, 2, 3, 1, 2, 3, 1, 2]] * 2  # fmt: skip
TEMPS = [0.0, 0.0, 0.0, 1.0, 0.7, 0.9]
# (min-p and logit bias: vLLM refuses them with speculation, per request; tested below.)
TRUNCS: list[Truncation | None] = [
    None, None, Truncation(top_k=5), None, Truncation(top_p=0.9), Truncation(top_k=20),
]  # fmt: skip
PENALTIES: list[Penalties | None] = [
    # (penalties that favour repeats: the greedy request loops, so its drafts are accepted)
    None, Penalties.of(repetition_penalty=0.7, frequency_penalty=-0.3), None,
    Penalties.of(allowed_token_ids=range(0, 400)), Penalties.of(presence_penalty=0.2), None,
]  # fmt: skip


def _forget_drafts_in_histories(worker: Any) -> None:
    """Injected into the worker: draft rows' penalty histories without the drafts before them."""
    from isoexec.vllm import spec_decode

    real = spec_decode._row_layout

    def short(metadata: Any, outputs: Any, num_rows: int) -> Any:
        req, _ = real(metadata, outputs, num_rows)
        return req, [list(outputs[r]) if r < len(outputs) else [] for r in req]

    short.real = real  # type: ignore[attr-defined]
    spec_decode._row_layout = short


def _restore_histories(worker: Any) -> None:
    from isoexec.vllm import spec_decode

    spec_decode._row_layout = spec_decode._row_layout.real  # type: ignore[attr-defined]


def _stock_verifier(worker: Any) -> None:
    """Injected into the worker: vLLM's own rejection sampler behind IsoExec's sampler."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    runner = worker.model_runner
    runner.isoexec_kept_verifier = runner.rejection_sampler
    runner.rejection_sampler = RejectionSampler(runner.sampler)


def _restore_verifier(worker: Any) -> None:
    runner = worker.model_runner
    runner.rejection_sampler = runner.isoexec_kept_verifier


def _spec_engine(
    engine_pool: Callable[..., Any], model: str, dtype: str = "float32", k: int = 3
) -> Any:
    ngram = tuple((key, k if key == "num_speculative_tokens" else v) for key, v in NGRAM)
    return engine_pool(model=model, dtype=dtype, isoexec=True, speculative=ngram)


def _score(trainer: Any, done: list[Any], temps: list[float] = TEMPS, settings: bool = True) -> Any:
    if not settings:
        return score_completions(trainer, done, temps)
    return score_completions(trainer, done, temps, TRUNCS, penalties=PENALTIES)


# dense fp32 last: the tests below reuse its engine
@pytest.mark.parametrize(
    ("preset", "dtype"),
    [("tiny-moe", "float32"), ("tiny-dense", "bfloat16"), ("tiny-dense", "float32")],
)
def test_speculated_tokens_are_bitwise_the_trainers(
    preset: str,
    dtype: str,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    model = model_factory(preset, dtype)
    engine = _spec_engine(engine_pool, model, dtype)
    before = engine.call("spec_decode_counts")
    done = sample(engine, PROMPTS, TEMPS, TOKENS, truncations=TRUNCS, penalties=PENALTIES)
    proposed, accepted = (a - b for a, b in zip(engine.call("spec_decode_counts"), before,
                                                 strict=True))  # fmt: skip
    print(f"n-gram drafts: {accepted}/{proposed} accepted")
    assert proposed > 0 and accepted > 0  # the verification path ran, and kept drafts
    trainer = trainer_factory(model, dtype, isoexec=True)
    train, eng = _score(trainer, done)
    assert train.numel() == TOKENS * len(PROMPTS)
    assert torch.equal(train, eng), (train - eng).abs().max()
    plain, _ = _score(trainer, done, settings=False)
    assert not torch.equal(plain, eng)  # negative control: scored without the settings

    # The same greedy requests on an engine without speculation: the same tokens, the same bits.
    plain_engine = engine_pool(model=model, dtype=dtype, isoexec=True)
    greedy = [0, 1, 2]
    again = sample(plain_engine, [PROMPTS[i] for i in greedy], [0.0] * 3, TOKENS,
                   truncations=[TRUNCS[i] for i in greedy],
                   penalties=[PENALTIES[i] for i in greedy])  # fmt: skip
    for i, c in zip(greedy, again, strict=True):
        assert c.token_ids == done[i].token_ids, i
        assert c.logprobs == done[i].logprobs, i


@pytest.mark.parametrize("k", [1, 5])
def test_bitwise_at_other_draft_lengths(
    k: int,
    tiny_dense_dir: str,
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    """k=1 (a verification chunk of 2 rows) and k=5 (6 rows): drafts are accepted, and every
    returned logprob is still the trainer's processed logprob of that token at that position."""
    engine = _spec_engine(engine_pool, tiny_dense_dir, k=k)
    before = engine.call("spec_decode_counts")
    done = sample(engine, PROMPTS, TEMPS, TOKENS, truncations=TRUNCS, penalties=PENALTIES)
    proposed, accepted = (a - b for a, b in zip(engine.call("spec_decode_counts"), before,
                                                 strict=True))  # fmt: skip
    print(f"k={k}: n-gram drafts {accepted}/{proposed} accepted")
    assert proposed > 0 and accepted > 0
    trainer = trainer_factory(tiny_dense_dir, "float32", isoexec=True)
    train, eng = _score(trainer, done)
    assert torch.equal(train, eng), (train - eng).abs().max()
    assert not torch.equal(_score(trainer, done, settings=False)[0], eng)  # negative control


@pytest.mark.parametrize(
    "setting", [{"min_p": 0.1}, {"extra": (("logit_bias", {5: 1.0}),)}], ids=["min_p", "bias"]
)
def test_what_vllm_refuses_with_speculation_is_refused_per_request(
    setting: dict[str, Any], tiny_dense_dir: str, engine_pool: Callable[..., Any]
) -> None:
    """vLLM's own frontend refuses min-p and logit bias with speculation (its rejection
    sampler cannot apply them): that request alone, and the engine serves on."""
    from isoexec.vllm.engine_process import EngineError
    from isoexec.vllm.engine_types import SamplingSpec

    engine = _spec_engine(engine_pool, tiny_dense_dir)
    with pytest.raises(EngineError, match="not yet supported with speculative decoding"):
        engine.generate([PROMPTS[0]], SamplingSpec(max_tokens=4, **setting))
    assert len(engine.generate([PROMPTS[0]], SamplingSpec(max_tokens=4))[0].token_ids) == 4


def test_negative_control_draft_rows_that_forget_the_drafts_are_caught(
    tiny_dense_dir: str, engine_pool: Callable[..., Any], trainer_factory: Callable[..., Any]
) -> None:
    """A rejection sampler whose draft rows apply the penalties without the drafts before them
    returns other bits for the penalised request, wherever a draft was accepted before a
    position; the trainer's scoring catches it."""
    engine = _spec_engine(engine_pool, tiny_dense_dir)
    trainer = trainer_factory(tiny_dense_dir, "float32", isoexec=True)
    good = sample(engine, PROMPTS, TEMPS, TOKENS, truncations=TRUNCS, penalties=PENALTIES)
    assert torch.equal(*_score(trainer, good))
    engine.call("collective_rpc", _forget_drafts_in_histories)
    try:
        bad = sample(engine, PROMPTS, TEMPS, TOKENS, truncations=TRUNCS, penalties=PENALTIES)
    finally:
        engine.call("collective_rpc", _restore_histories)
    train, eng = _score(trainer, bad)
    assert not torch.equal(train, eng)
    assert bad[0].logprobs == good[0].logprobs  # the request without settings: unchanged


def test_the_contract_records_speculation_and_a_stock_verifier_is_refused(
    tiny_dense_dir: str, engine_pool: Callable[..., Any], trainer_factory: Callable[..., Any]
) -> None:
    """The speculating IsoExec engine declares "invariant" (its returned bits do not depend on
    speculation, tested above) and MATCHes its trainer through the real handshake. With vLLM's
    own rejection sampler swapped in, the same engine declares "ngram/3" and is refused, and
    the diff names the setting; so does a stock engine speculating."""
    import json
    from pathlib import Path

    from isoexec.contract.contract import Contract
    from isoexec.megatron import trainer_contract
    from isoexec.tools.pair import handshake

    hf = json.loads((Path(tiny_dense_dir) / "config.json").read_text())
    trainer = trainer_contract(trainer_factory(tiny_dense_dir, "float32", isoexec=True), hf)
    engine = _spec_engine(engine_pool, tiny_dense_dir)
    assert Contract.from_bytes(engine.call("contract")).speculation == "invariant"
    t_verdict, e_verdict = handshake(trainer, engine, run_id="speculating-engine")
    assert t_verdict.matched and e_verdict["outcome"] == "MATCH", e_verdict
    # what the contract does not hash, the verdict reports: the engine's method and k
    reported = {"speculative": "ngram/3", "tensor_parallel_size": "1"}
    assert {p.label: dict(p.settings) for p in t_verdict.participants}["engine/0"] == reported
    assert e_verdict["settings"]["engine/0"] == reported
    engine.call("collective_rpc", _stock_verifier)
    try:
        swapped = Contract.from_bytes(engine.call("contract"))
        t_verdict, e_verdict = handshake(trainer, engine, run_id="stock-verifier")
    finally:
        engine.call("collective_rpc", _restore_verifier)
    assert swapped.speculation == "ngram/3"
    assert e_verdict["outcome"] == "MISMATCH" and not t_verdict.matched
    assert "speculation.verification: invariant → ngram/3" in t_verdict.diff, t_verdict.diff
    assert Contract.from_bytes(engine.call("contract")) == trainer  # restored
    stock = engine_pool(model=tiny_dense_dir, dtype="float32", isoexec=False, speculative=NGRAM)
    assert Contract.from_bytes(stock.call("contract")).speculation == "ngram/3"
