"""Engine at TP=2 (vLLM's own multiprocess executor, gloo on CPU): a MATCH means bitwise.

The fail-open this closes: an engine at TP=2 whose row-parallel sites ran the canonical linear
on each rank's K-shard and vLLM's all-reduce of the rounded partials declared the TP=1 contract,
MATCHed a TP=1 trainer and produced other bits. Now such a site records the TP degree it ran at
("2"), so the handshake refuses it, naming the site. With `tp_invariant`, vLLM's row-parallel
sites run `linear_tp` across the ranks (each rank's fixed K-leaves, vLLM's all-gather in rank
order, the trainer's tree), every site records "invariant", and the engine at TP=2 MATCHes
trainers at TP=1 and TP=2 and is bitwise equal to both on every sampled token. Qwen3-MoE too:
the engine's MoE runner gathers each rank's expert shards whole (the canonical combine runs
whole experts, as the trainer does at every TP) instead of all-reducing rounded partials.

The model's row-parallel K is 128 (2 heads x 64; intermediate 128): at TP=2 each rank's K is
64, so the stock negative control (TP=2 sums two rounded partials, TP=1 runs one GEMM over K)
differs whatever BLAS runs underneath (no BLAS splits so short a K into blocks itself).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _pairing import assert_tp_invariant_match_and_bitwise, scoring_jobs

from isoexec.contract.contract import Contract
from isoexec.contract.handshake.server import HandshakeServer
from isoexec.contract.options import IsoExecOptions
from isoexec.contract.pair import handshake, make_prompts
from isoexec.contract.tiny_models import make_tiny_model
from isoexec.vllm.engine_process import SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

NARROW_K = {"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128}
# (preset, dtype): Qwen3 dense and MoE, and the GDN hybrids. The MoE engine gathers each
# expert (and the shared expert) whole on every rank (vLLM shards them over TP), as the trainer
# holds them at every TP; GDN heads are per-head ops on each rank's heads, out_proj linear_tp.
CASES = (
    ("tiny-dense", "float32"),
    ("tiny-dense", "bfloat16"),
    ("tiny-moe", "float32"),
    ("tiny-moe", "bfloat16"),
    ("tiny-gdn", "float32"),  # Qwen3-Next: GDN layers, gated attention, MoE + shared expert
    ("tiny-qwen35", "float32"),  # Qwen3.5 text: flat GDN projections
)
DENSE32 = ("tiny-dense", "float32")
CHUNK = 64
TEMPS = [1.0, 0.7, 1.0, 0.7]
TP_INVARIANT = IsoExecOptions(tp_invariant=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    root: Path = tmp_path_factory.mktemp("engine-tp")
    return {
        (preset, dtype): str(
            make_tiny_model(preset, root / f"{preset}-{dtype}", dtype=dtype, overrides=NARROW_K)
        )
        for preset, dtype in CASES
    }


def _engine(engine_pool: Callable[..., Any], model: str, dtype: str, **kw: Any) -> Any:
    # Eager, to keep CI within its budget: these tests are about the TP layout; the compiled
    # path at TP=2 runs in the `isoexec pair --engine-tp 2` tests below (vLLM's default mode),
    # and compiled == eager is shown in tests/vllm/test_compiled_engine.py.
    return engine_pool(
        model=model, dtype=dtype, max_num_batched_tokens=CHUNK, enforce_eager=True, **kw
    )


@pytest.fixture(scope="module")
def tp_run(
    models: dict[tuple[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> dict[str, Any]:
    """Each case's TP=2 engine samples; one torchrun launch scores it all at TP=1 and TP=2
    (plus the default-options TP=1 contract, for the fail-closed check)."""
    sampled: dict[tuple[str, str], list[Any]] = {}
    jobs: list[dict[str, Any]] = []
    for (preset, dtype), model in models.items():
        engine = _engine(engine_pool, model, dtype, isoexec=True, options=TP_INVARIANT,
                         tensor_parallel_size=2)  # fmt: skip
        engine.call("reset_prefix_cache")
        prompts = make_prompts(len(TEMPS), 512, seed=12)
        sampled[preset, dtype] = engine.generate(
            prompts, [SamplingSpec(max_tokens=6, temperature=t) for t in TEMPS]
        )
        for tp in (1, 2):
            jobs += scoring_jobs(
                sampled[preset, dtype], TEMPS, model=model, dtype=dtype, tp=tp, isoexec=True,
                options=TP_INVARIANT.to_dict(), contract=True,
            )  # fmt: skip
    jobs.append({"model": models[DENSE32], "dtype": "float32", "tp": 1, "isoexec": True,
                 "contract": True, "seqs": [[1, 2, 3]]})  # fmt: skip
    results = run_tp_jobs(jobs, [])
    return {"sampled": sampled, "jobs": jobs, "results": results}


@pytest.mark.parametrize("trainer_tp", [1, 2])
@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_tp2_engine_matches_and_equals_trainer_bitwise(
    preset: str,
    dtype: str,
    trainer_tp: int,
    tp_run: dict[str, Any],
    models: dict[tuple[str, str], str],
    engine_pool: Callable[..., Any],
) -> None:
    model = models[preset, dtype]
    engine = _engine(engine_pool, model, dtype, isoexec=True, options=TP_INVARIANT,
                     tensor_parallel_size=2)  # fmt: skip
    mine = [(j, r) for j, r in zip(tp_run["jobs"], tp_run["results"], strict=True)
            if j["model"] == model and j["tp"] == trainer_tp and "temperature" in j]  # fmt: skip
    assert_tp_invariant_match_and_bitwise(
        mine, engine, tp_run["sampled"][preset, dtype], TEMPS,
        run_id=f"engine-tp2-{preset}-{dtype}-trainer-tp{trainer_tp}",
    )  # fmt: skip


def test_fail_closed_tp2_engine_with_all_reduce_is_refused(
    tp_run: dict[str, Any], models: dict[tuple[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    """The measured fail-open: IsoExec on, engine TP=2 without `tp_invariant` (vLLM's all-reduce
    at the row-parallel sites), trainer TP=1. Its contract records TP=2 at those sites; the
    handshake says MISMATCH and the diff names them and the degrees."""
    engine = _engine(engine_pool, models[DENSE32], "float32", isoexec=True,
                     tensor_parallel_size=2)  # fmt: skip
    mine = Contract.from_bytes(engine.call("contract"))
    pinned = sorted(s.name for s in mine.sites if s.tp != "invariant")
    assert pinned and all(n.endswith((".o_proj", ".down_proj")) for n in pinned), pinned
    assert {mine.site(n).tp for n in pinned} == {"2"}
    trainer = Contract.from_bytes(tp_run["results"][-1]["contract"])  # TP=1, default options
    trainer_verdict, engine_verdict = handshake(trainer, engine, run_id="engine-tp2-all-reduce")
    assert engine_verdict["outcome"] == "MISMATCH" and not trainer_verdict.matched
    diff = "\n".join(trainer_verdict.diff)
    assert "o_proj" in diff and "down_proj" in diff and "tp" in diff, diff
    # A deliberately changed site (the TP-invariant engine's o_proj leaves) is refused too.
    inv = _engine(engine_pool, models[DENSE32], "float32", isoexec=True, options=TP_INVARIANT,
                  tensor_parallel_size=2)  # fmt: skip
    assert Contract.from_bytes(inv.call("contract")).hash != mine.hash


def test_negative_control_stock_engine_tp2_differs_from_tp1(
    models: dict[tuple[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    """Stock vLLM: TP=2 sums the ranks' rounded row-parallel partials, TP=1 runs one GEMM: the
    same prompts' logprobs differ. IsoExec's TP=2 engine (the test above) does not."""
    prompts = make_prompts(4, 512, seed=13)
    spec = SamplingSpec(max_tokens=1, prompt_logprobs=True)
    logprobs = {}
    for tp in (1, 2):
        eng = _engine(engine_pool, models[DENSE32], "float32", tensor_parallel_size=tp)
        logprobs[tp] = [c.prompt_logprobs for c in eng.generate(prompts, spec)]
    pairs = zip(logprobs[1], logprobs[2], strict=True)
    differ = sum(a != b for p, q in pairs for a, b in zip(p, q, strict=True))
    print("stock engine TP=2 vs TP=1: prompt logprobs that differ:", differ)
    assert differ > 0


@pytest.mark.parametrize(
    ("trainer_pp", "fault_rank"), [(1, None), (1, 1), (2, None), (2, 3)], ids=str
)
def test_every_rank_of_both_sides_offers_and_one_verdict_covers_the_run(
    trainer_pp: int,
    fault_rank: int | None,
    models: dict[tuple[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
    tmp_path: Path,
) -> None:
    """Trainer TP=2 x PP=`trainer_pp` (torchrun, 2 or 4 ranks) and engine TP=2 (2 vLLM
    workers): every participant offers the contract read back from its own model (a pipeline
    stage reads its own layers and gathers the others'), one verdict for all. With a changed
    site on one trainer rank only (a wider attention tile in the last layer; at PP=2 the last
    stage's), every participant, engine workers included, gets MISMATCH and the diff names
    the site."""
    token = secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    engine = _engine(engine_pool, models[DENSE32], "float32", isoexec=True, options=TP_INVARIANT,
                     tensor_parallel_size=2)  # fmt: skip
    run_id = f"many-ranks-pp{trainer_pp}-fault-{fault_rank}"
    got: dict[str, Any] = {}
    with HandshakeServer({"trainer": 2 * trainer_pp, "engine": 2}, token) as server:

        def engine_offers() -> None:
            got["engine"] = engine.call("handshake", server.address, token, run_id)

        t = threading.Thread(target=engine_offers, daemon=True)
        t.start()
        hs = {"address": server.address, "token_file": str(token_file), "run_id": run_id}
        job = {"model": models[DENSE32], "dtype": "float32", "tp": 2, "pp": trainer_pp,
               "isoexec": True, "options": TP_INVARIANT.to_dict(), "seqs": [[1, 2, 3]],
               "handshake": hs, "fault_rank": fault_rank}  # fmt: skip
        (trainer,) = run_tp_jobs([job], [], nproc=2 * trainer_pp)
        t.join(timeout=120)
    assert len(got["engine"]) == 2, got
    outcomes = [v["outcome"] for v in got["engine"]] + [trainer["verdict"]["outcome"]]
    if fault_rank is None:
        assert outcomes == ["MATCH"] * 3, got
    else:
        assert outcomes == ["MISMATCH"] * 3, got
        diff = "\n".join(trainer["verdict"]["diff"])
        assert "layers.1.self_attn.core" in diff, diff
        assert got["engine"][0]["diff"] == trainer["verdict"]["diff"]


def test_pair_checks_a_layout_in_one_command(tmp_path: Path) -> None:
    """`isoexec pair --engine-tp 2 --trainer-tp 2`: vLLM's executor at TP=2, a torchrun trainer
    at TP=2 whose ranks each offer their contract; MATCH and every sampled token bitwise (exit
    0). The stock arm of the same command is not bitwise (the comparison can fail)."""
    import json

    from isoexec.contract.cli import main

    out = tmp_path / "pair"
    args = ["pair", "--preset", "tiny-moe", "--engine-tp", "2", "--trainer-tp", "2",
            "--num-prompts", "4", "--max-tokens", "6", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    arms = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["arms"]}
    assert arms["isoexec"]["handshake"].startswith("MATCH")
    assert arms["isoexec"]["bitwise_equal"] == arms["isoexec"]["tokens"] == 24
    assert arms["stock"]["bitwise_equal"] < arms["stock"]["tokens"]


def test_pair_with_a_pipelined_trainer(tmp_path: Path) -> None:
    """`isoexec pair --engine-tp 2 --trainer-tp 2 --trainer-pp 2`: a 4-rank torchrun trainer
    (two pipeline stages of two TP ranks, Megatron's schedule) against a TP=2 engine; MATCH
    and every sampled token bitwise."""
    import json

    from isoexec.contract.cli import main

    out = tmp_path / "pair"
    args = ["pair", "--preset", "tiny-dense", "--engine-tp", "2", "--trainer-tp", "2",
            "--trainer-pp", "2", "--arms", "isoexec", "--num-prompts", "4", "--max-tokens", "6",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    (arm,) = json.loads((out / "results.json").read_text())["arms"]
    assert arm["handshake"].startswith("MATCH")
    assert arm["bitwise_equal"] == arm["tokens"] == 24
