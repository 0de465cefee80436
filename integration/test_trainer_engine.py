"""The product's claim, end to end: trainer logprobs == engine logprobs, bit for bit.

Real vLLM (its own process) samples a mixed batch — different prompt lengths, shared prefixes
with prefix caching on, a long prompt that gets chunked (`max_num_batched_tokens=64`),
temperatures 1.0 and 0.7 — after the contract handshake said MATCH; the real Megatron trainer
scores exactly the sampled sequences (packed). Negative controls: the stock arm differs, and a
trainer with one deliberately changed site is refused by the handshake.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _faults import narrow_attention_lanes

from isoexec.megatron import trainer_contract
from isoexec.ops.penalties import Penalties
from isoexec.ops.truncation import Truncation
from isoexec.tools.pair import handshake, make_prompts, sample_and_score
from isoexec.tools.pair_steps import sample, score_completions, score_full_rows

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

CHUNK = 64
TEMPS = [1.0, 0.7, 1.0, 0.7, 1.0, 0.7]
# One request per truncation rule, and combined (Qwen3's shipped top_k 20 / top_p 0.95 at 0.6).
TRUNCATIONS = [
    Truncation(top_k=8),
    Truncation(top_p=0.8),
    Truncation(min_p=0.2),
    Truncation(top_k=20, top_p=0.95),
    Truncation(top_k=30, top_p=0.9, min_p=0.05),
    Truncation(top_k=3),
]
TRUNC_TEMPS = [1.0, 0.9, 1.0, 0.6, 0.8, 0.0]  # the last greedy: vLLM drops its truncation
# One request per adjustment (penalties, logit bias, allowed tokens), one combined with
# truncation, and a greedy one (vLLM applies penalties to greedy requests too).
PENALTIES = [
    Penalties.of(repetition_penalty=1.3),
    Penalties.of(frequency_penalty=0.5, presence_penalty=0.3),
    Penalties.of(logit_bias={3: 4.0, 11: -3.0, 200: 100.0}),
    Penalties.of(allowed_token_ids=range(0, 300, 2)),
    Penalties.of(1.1, 0.2, -0.1, {5: 2.0}),
    Penalties.of(repetition_penalty=1.5, frequency_penalty=1.0),
]
PEN_TEMPS = [1.0, 0.8, 1.0, 0.9, 0.6, 0.0]
PEN_TRUNCS: list[Truncation | None] = [
    None,
    None,
    None,
    None,
    Truncation(top_k=20, top_p=0.95),
    None,
]


# vLLM's `support_torch_compile` wrapper on the inner model: off in eager mode, else it sets
# `compiled` once it has compiled the forward.
_DO_NOT_COMPILE = operator.attrgetter("model_runner.model.model.do_not_compile")
_COMPILED = operator.attrgetter("model_runner.model.model.compiled")


def _engine(engine_pool: Callable[..., Any], model: str, dtype: str, isoexec: bool) -> Any:
    """max_logprobs=-1: whole processed rows may be asked for (full-vocab comparisons)."""
    return engine_pool(
        model=model, dtype=dtype, isoexec=isoexec, max_num_batched_tokens=CHUNK, max_logprobs=-1
    )


def _hf(model: str) -> dict[str, Any]:
    return json.loads((Path(model) / "config.json").read_text())


def _contracts_match(contract: Any, engine: Any, run_id: str) -> None:
    trainer_verdict, engine_verdict = handshake(contract, engine, run_id=run_id)
    assert trainer_verdict.matched and engine_verdict["outcome"] == "MATCH", trainer_verdict
    assert engine_verdict["hash"] == contract.hash


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-gdn", "tiny-qwen35"])
def test_trainer_equals_engine_bitwise(
    preset: str,
    dtype: str,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    model_dir = model_factory(preset, dtype)
    engine = _engine(engine_pool, model_dir, dtype, True)
    # vLLM's default mode: its torch.compile wrapper is on (IsoExec's own Qwen3.5 class too)
    assert engine.call("collective_rpc", _DO_NOT_COMPILE) == [False]
    trainer = trainer_factory(model_dir, dtype)
    contract = trainer_contract(trainer, _hf(model_dir), dtype)
    _contracts_match(contract, engine, f"{preset}-{dtype}")

    prompts = make_prompts(len(TEMPS), int(_hf(model_dir)["vocab_size"]), seed=3)
    assert max(map(len, prompts)) > 2 * CHUNK  # one prompt is prefilled in several chunks
    train, eng = sample_and_score(engine, trainer, prompts, TEMPS, max_tokens=6)
    assert train.numel() == 6 * len(prompts)
    assert torch.equal(train, eng), (train - eng).abs().max()
    assert engine.call("collective_rpc", _COMPILED) == [True]  # it ran the compiled graph

    # Truncated sampling (the same engine, so no second start): top-k, top-p, min-p and
    # combined, each request with its own settings in one batch, scored with the same.
    # Whole processed rows come back too (vLLM's logprobs=-1) and equal the trainer's.
    done = sample(engine, prompts, TRUNC_TEMPS, 6, truncations=TRUNCATIONS, full_vocab=True)
    train, eng = score_completions(trainer, done, TRUNC_TEMPS, TRUNCATIONS)
    assert torch.equal(train, eng), (train - eng).abs().max()
    assert torch.isfinite(train).all()  # every sampled token is in the trainer's kept set
    train_rows, engine_rows = score_full_rows(trainer, done, TRUNC_TEMPS, TRUNCATIONS)
    assert train_rows.shape == (train.numel(), _hf(model_dir)["vocab_size"])
    assert torch.equal(train_rows, engine_rows)
    kept = torch.isfinite(engine_rows).sum(-1)
    assert int(kept.min()) >= 1 and int(kept.max()) == engine_rows.shape[1]  # truncated and not
    # Negative control: the trainer scoring the same tokens without the truncation differs.
    untruncated, _ = score_completions(trainer, done, TRUNC_TEMPS)
    assert not torch.equal(untruncated, eng)

    # Penalties, logit bias and allowed tokens (the same engine): scored from each sequence's
    # own history, every token and every whole row equal; without them, every request differs.
    done = sample(
        engine, prompts, PEN_TEMPS, 6, truncations=PEN_TRUNCS, full_vocab=True, penalties=PENALTIES
    )
    assert all(t % 2 == 0 and t < 300 for t in done[3].token_ids)  # the allow-list held
    train, eng = score_completions(trainer, done, PEN_TEMPS, PEN_TRUNCS, penalties=PENALTIES)
    assert torch.equal(train, eng), (train - eng).abs().max()
    rows = score_full_rows(trainer, done, PEN_TEMPS, PEN_TRUNCS, penalties=PENALTIES)
    assert torch.equal(*rows)
    plain, _ = score_completions(trainer, done, PEN_TEMPS, PEN_TRUNCS)
    differs = (plain != eng).reshape(len(prompts), 6).any(-1)
    assert bool(differs.all()), differs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_negative_control_stock_arm_differs(
    dtype: str,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    """Same run with IsoExec off on both sides: the logprobs are not bitwise equal."""
    model_dir = model_factory("tiny-dense", dtype)
    engine = _engine(engine_pool, model_dir, dtype, False)
    trainer = trainer_factory(model_dir, dtype, isoexec=False)
    prompts = make_prompts(len(TEMPS), 512, seed=3)
    train, eng = sample_and_score(engine, trainer, prompts, TEMPS, max_tokens=6)
    mismatches = int((train != eng).sum())
    print(f"stock arm {dtype}: {mismatches}/{train.numel()} tokens differ")
    assert mismatches > 0
    assert float((train - eng).abs().max()) < 0.5  # the same model, just other kernels
    # Whole rows: the stock arm's differ too (the full-vocab comparison can fail).
    done = sample(engine, prompts, TEMPS, 4, full_vocab=True)
    train_rows, engine_rows = score_full_rows(trainer, done, TEMPS)
    equal_rows = int((train_rows == engine_rows).all(-1).sum())
    print(f"stock arm {dtype}: {equal_rows}/{train_rows.shape[0]} full rows bitwise")
    assert equal_rows < train_rows.shape[0]


def test_stock_arm_serves_qwen3_5_causal_lm(
    tmp_path_factory: pytest.TempPathFactory,
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    """`Qwen3_5ForCausalLM` with IsoExec off on both sides: stock vLLM samples it text-only
    (IsoExec's registration with vLLM's own layers; stock vLLM's class needs torchvision) and
    its logprobs agree with stock Megatron's to bf16 rounding without being bitwise equal.
    bf16 with 128-wide GDN heads: stock vLLM-CPU's GDN kernel accepts nothing else."""
    from isoexec.tools.tiny_models import make_tiny_model

    wide = {"linear_key_head_dim": 128, "linear_value_head_dim": 128}
    model_dir = str(
        make_tiny_model(
            "tiny-qwen35", tmp_path_factory.mktemp("q35-128"), dtype="bfloat16", overrides=wide
        )
    )
    assert _hf(model_dir)["architectures"] == ["Qwen3_5ForCausalLM"]
    engine = _engine(engine_pool, model_dir, "bfloat16", False)
    trainer = trainer_factory(model_dir, "bfloat16", isoexec=False)
    prompts = make_prompts(4, int(_hf(model_dir)["vocab_size"]), seed=5)
    train, eng = sample_and_score(engine, trainer, prompts, TEMPS[:4], max_tokens=6)
    mismatches = int((train != eng).sum())
    print(f"stock Qwen3_5ForCausalLM bf16: {mismatches}/{train.numel()} tokens differ")
    assert mismatches > 0
    assert float((train - eng).abs().max()) < 0.5  # the same model, just other kernels


def test_changed_site_is_refused_on_both_sides(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    from isoexec.handshake.types import ContractMismatchError
    from isoexec.vllm.engine_process import EngineError

    model_dir = model_factory("tiny-dense", "float32")
    engine = _engine(engine_pool, model_dir, "float32", True)
    trainer = trainer_factory(model_dir, "float32", fresh=True)
    core = trainer.decoder.layers[1].self_attention.core_attention
    narrow_attention_lanes(core)

    contract = trainer_contract(trainer, _hf(model_dir), "float32")
    trainer_verdict, engine_verdict = handshake(contract, engine, run_id="changed-site")
    assert engine_verdict["outcome"] == "MISMATCH"
    assert not trainer_verdict.matched
    first = trainer_verdict.diff[0]
    assert "layers.1.self_attn.core" in first and "lanes" in first, trainer_verdict.diff
    with pytest.raises(ContractMismatchError):
        trainer_verdict.raise_for_mismatch()  # the trainer side refuses to sync
    with pytest.raises(EngineError, match="no MATCH from the handshake"):
        engine.call("load_weights", "/nonexistent.safetensors", "0" * 64)  # engine refuses

    # The change is real: the changed trainer's bits differ from the engine's.
    prompts = make_prompts(3, 512, seed=5)
    train, eng = sample_and_score(engine, trainer, prompts, [1.0] * 3, max_tokens=4)
    assert not torch.equal(train, eng)


def test_logprobs_mode_is_in_the_contract(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    """An engine returning raw (T=1) logprobs declares it at its logprobs site: a trainer
    scoring the sampled distribution (processed, the default) is refused at the handshake with
    that site in the diff; a trainer in raw mode MATCHes and is bitwise at every temperature."""
    from isoexec.contract.options import IsoExecOptions

    raw = IsoExecOptions(logprobs_mode="raw_logprobs")
    model_dir = model_factory("tiny-dense", "float32")
    engine = engine_pool(model=model_dir, isoexec=True, max_num_batched_tokens=CHUNK,
                         options=raw, enforce_eager=True)  # fmt: skip
    hf = _hf(model_dir)
    processed = trainer_contract(trainer_factory(model_dir, "float32"), hf, "float32")
    tv, ev = handshake(processed, engine, run_id="raw-vs-processed")
    assert not tv.matched and ev["outcome"] == "MISMATCH"
    assert any("logprobs" in d and "raw_logprobs" in d for d in tv.diff), tv.diff

    trainer = trainer_factory(model_dir, "float32", options=raw)
    _contracts_match(trainer_contract(trainer, hf, "float32"), engine, "raw-mode")
    prompts = make_prompts(len(TEMPS), int(hf["vocab_size"]), seed=4)
    train, eng = sample_and_score(engine, trainer, prompts, TEMPS, max_tokens=4)
    assert torch.equal(train, eng)
    # Negative control: the processed trainer scores T=0.7 tokens at T=0.7, the engine at 1.
    processed_lp, raw_lp = sample_and_score(
        engine, trainer_factory(model_dir, "float32"), prompts, TEMPS, max_tokens=4
    )
    assert not torch.equal(processed_lp, raw_lp)


def _contracts_then_canaries(
    trainer: Any, hf: dict[str, Any], engine: Any, run_id: str, versions: int = 1
) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
    """Contracts offered by both sides, then (only after MATCH) both canaries for weights
    versions 0..versions-1: (trainer contract verdict, engine's, and the last canary verdicts
    of the trainer and the engine)."""
    import secrets

    from isoexec.handshake.server import HandshakeServer
    from isoexec.tools.pair_steps import canaries

    token = secrets.token_hex(16)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as hs:
        t_contract, e_contract = handshake(
            trainer_contract(trainer, hf, "float32"), engine, run_id, server=hs, token=token
        )
        assert t_contract.matched and e_contract["outcome"] == "MATCH", t_contract
        got: dict[str, Any] = {}
        for version in range(versions):
            got["t"], got["e"] = canaries(trainer, engine, hs.address, token, run_id, version)
            print(f"canary v{version}: {got['t'].summary}; the engine's batch took "
                  f"{got['e']['engine_scored_s'] * 1e3:.0f} ms")  # fmt: skip
    return t_contract, e_contract, got["t"], got["e"]


def test_canary_matches_after_the_contracts(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    """After MATCH both sides score the run's 64-token probe (the engine in a batch with three
    other requests) and the service finds the 63 logprobs bitwise equal, for the weights as
    loaded and again for a second weights version. What each costs is printed."""
    model_dir = model_factory("tiny-dense", "float32")
    engine = _engine(engine_pool, model_dir, "float32", True)
    trainer = trainer_factory(model_dir, "float32")
    hf = _hf(model_dir)
    *_, t_canary, e_canary = _contracts_then_canaries(trainer, hf, engine, "canary", versions=2)
    assert t_canary.matched and e_canary["matched"], e_canary
    assert "63 logprobs bitwise equal" in e_canary["summary"]


def test_canary_refuses_what_a_disabled_config_check_let_through(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    """The canary catches what the contract failed to describe. The trainer is built from the
    same weights with `rms_norm_eps` 0.01 (a config override), and the contract's config check
    is disabled, so the contract claims the checkpoint's config: both sides say MATCH. The
    canary refuses, naming the first differing probe position and both values. Negative
    control of the check itself: with it on, that trainer's contract cannot even be built."""
    import shutil

    from isoexec.megatron import readback as contract_readback

    model_dir = model_factory("tiny-dense", "float32")
    overridden = tmp_path / "overridden"
    shutil.copytree(model_dir, overridden)
    hf = _hf(model_dir)
    (overridden / "config.json").write_text(json.dumps({**hf, "rms_norm_eps": 0.01}))
    trainer = trainer_factory(str(overridden), "float32", fresh=True)
    with pytest.raises(ValueError, match="is not the config the model was built from"):
        trainer_contract(trainer, hf, "float32")
    monkeypatch.setattr(contract_readback, "_check_model", lambda model, cfg: None)
    engine = _engine(engine_pool, model_dir, "float32", True)
    t_contract, _, t_canary, e_canary = _contracts_then_canaries(trainer, hf, engine, "blind")
    assert t_contract.matched  # the contract was fooled
    assert not t_canary.matched and not e_canary["matched"]
    assert e_canary["first_position"] >= 1
    assert (
        "canary MISMATCH at weights version 0: canary differs first at probe position"
        in (e_canary["summary"])
    )
