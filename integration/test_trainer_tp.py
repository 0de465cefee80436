"""Trainer at TP=2 == engine at TP=1, bit for bit: the feature equal-TP systems cannot offer.

A real 2-rank gloo trainer (`torchrun`, Megatron TP=2) and a real vLLM engine (TP=1) both run
with `IsoExecOptions(tp_invariant=True)`: row-parallel sites use the K-leaves `linear_tp`, every
other site is TP-invariant as it is, so both sides record the same contract ("invariant" at
every site) and the handshake says MATCH although the TP degrees differ. The trainer scores
exactly what the engine sampled. Negative control: the engine without the option records the
plain `linear` at o_proj/down_proj, and the handshake refuses the TP=2 trainer there.
Qwen3-Next (GDN hybrid, MoE with a shared expert) runs the same pairing: GDN heads split by
key-head group on the trainer, `out_proj` a `linear_tp` site on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _pairing import assert_tp_invariant_match_and_bitwise, scoring_jobs

from isoexec.contract.contract import Contract
from isoexec.contract.options import IsoExecOptions
from isoexec.tools.pair import handshake, make_prompts
from isoexec.vllm.engine_process import SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

CHUNK = 64
TEMPS = [1.0, 0.7, 1.0, 0.7]
CASES = (("tiny-dense", "float32"), ("tiny-dense", "bfloat16"), ("tiny-gdn", "float32"))
TP_INVARIANT = IsoExecOptions(tp_invariant=True)


def _engine(
    engine_pool: Callable[..., Any], model: str, dtype: str, options: IsoExecOptions
) -> Any:
    return engine_pool(  # eager for CI time; compiled TP runs in the pair tests
        model=model, dtype=dtype, isoexec=True, max_num_batched_tokens=CHUNK, options=options,
        enforce_eager=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tp_run(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> dict[str, Any]:
    """Sample on each case's engine, then score everything in one TP=2 torchrun launch."""
    sampled: dict[tuple[str, str], list[Any]] = {}
    jobs: list[dict[str, Any]] = []
    for preset, dtype in CASES:
        model = model_factory(preset, dtype)
        engine = _engine(engine_pool, model, dtype, TP_INVARIANT)
        engine.call("reset_prefix_cache")
        prompts = make_prompts(len(TEMPS), 512, seed=11)
        specs = [SamplingSpec(max_tokens=6, temperature=t) for t in TEMPS]
        sampled[preset, dtype] = engine.generate(prompts, specs)
        jobs += scoring_jobs(
            sampled[preset, dtype], TEMPS, model=model, dtype=dtype, tp=2, isoexec=True,
            options=TP_INVARIANT.to_dict(), contract=True,
        )  # fmt: skip
    results = run_tp_jobs(jobs, [])
    return {"sampled": sampled, "jobs": jobs, "results": results}


@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_tp2_trainer_equals_tp1_engine_bitwise(
    preset: str,
    dtype: str,
    tp_run: dict[str, Any],
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
) -> None:
    model = model_factory(preset, dtype)
    engine = _engine(engine_pool, model, dtype, TP_INVARIANT)
    mine = [(j, r) for j, r in zip(tp_run["jobs"], tp_run["results"], strict=True)
            if j["dtype"] == dtype and j["model"] == model]  # fmt: skip
    assert_tp_invariant_match_and_bitwise(
        mine, engine, tp_run["sampled"][preset, dtype], TEMPS, run_id=f"tp2-{preset}-{dtype}"
    )


def test_engine_without_the_option_refuses_the_tp2_trainer(
    tp_run: dict[str, Any],
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
) -> None:
    engine = _engine(
        engine_pool, model_factory("tiny-dense", "float32"), "float32", IsoExecOptions()
    )
    contract = Contract.from_bytes(tp_run["results"][0]["contract"])
    trainer_verdict, engine_verdict = handshake(contract, engine, run_id="tp2-plain-engine")
    assert engine_verdict["outcome"] == "MISMATCH" and not trainer_verdict.matched
    # The layout first (a global field), then the row-parallel sites that make it so.
    assert trainer_verdict.diff[0] == "parallel.tp: invariant → 1", trainer_verdict.diff
    sites = trainer_verdict.diff[1]
    assert "o_proj" in sites and "down_proj" in sites, trainer_verdict.diff
