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
import torch
from _pairing import aligned_logprobs, scoring_jobs

from isoexec.contract.contract import Contract
from isoexec.contract.options import IsoExecOptions
from isoexec.handshake.server import HandshakeServer
from isoexec.tools.pair import handshake, make_prompts
from isoexec.tools.tiny_models import make_tiny_model
from isoexec.vllm.engine_process import EngineError, SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

NARROW_K = {"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128}
# (preset, dtype): Qwen3 dense and MoE, and the GDN hybrids. The MoE engine gathers each
# expert (and the shared expert) whole on every rank (vLLM shards them over TP), as the trainer
# holds them at every TP; GDN heads are per-head ops on each rank's heads, out_proj linear_tp.
# CI runs one cell per family (dense, MoE, and Qwen3.5 text for the GDN layers); the other
# cells of the matrix carry the `matrix` marker (not in the default run, to keep CI within its
# time budget): `pytest integration/test_engine_tp.py -m matrix` runs them (README).
CI_CASES = (
    ("tiny-dense", "float32"),
    ("tiny-moe", "float32"),
    ("tiny-qwen35", "float32"),  # Qwen3.5 text: flat GDN projections, gated attention
)
MATRIX_CASES = (
    ("tiny-dense", "bfloat16"),
    ("tiny-moe", "bfloat16"),
    ("tiny-gdn", "float32"),  # Qwen3-Next: GDN layers, gated attention, MoE + shared expert
    ("tiny-qwen35-moe", "float32"),  # Qwen3.5-MoE as released (vision-language layout)
)
CASES = [pytest.param(*c, id="-".join(c)) for c in CI_CASES] + [
    pytest.param(*c, id="-".join(c), marks=pytest.mark.matrix) for c in MATRIX_CASES
]
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
        for preset, dtype in CI_CASES + MATRIX_CASES
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
    return _tp_run(CI_CASES, models, engine_pool, run_tp_jobs)


@pytest.fixture(scope="module")
def tp_run_matrix(
    models: dict[tuple[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> dict[str, Any]:
    return _tp_run(MATRIX_CASES, models, engine_pool, run_tp_jobs)


def _run_of(request: pytest.FixtureRequest, preset: str, dtype: str) -> dict[str, Any]:
    matrix = (preset, dtype) in MATRIX_CASES
    name = "tp_run_matrix" if matrix else "tp_run"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def _tp_run(
    cases_run: tuple[tuple[str, str], ...],
    all_models: dict[tuple[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> dict[str, Any]:
    """The trainer contracts first (one torchrun launch: TP=1 and TP=2 per case, plus the
    default-options TP=1 contract for the fail-closed check); then each case's TP=2 engine,
    started once: the handshake against both trainer contracts, its samples, its weight
    fingerprint; then one torchrun launch scores every sample at TP=1 and TP=2."""
    models = {case: all_models[case] for case in cases_run}
    opts = TP_INVARIANT.to_dict()
    contract_jobs = [
        {"model": model, "dtype": dtype, "tp": tp, "isoexec": True, "options": opts,
         "contract": True, "seqs": [[1, 2, 3]]}
        for (_, dtype), model in models.items() for tp in (1, 2)
    ]  # fmt: skip
    contract_jobs.append({"model": all_models[DENSE32], "dtype": "float32", "tp": 1,
                          "isoexec": True, "contract": True, "seqs": [[1, 2, 3]]})  # fmt: skip
    contracts = [Contract.from_bytes(r["contract"]) for r in run_tp_jobs(contract_jobs, [])]
    cases: dict[tuple[str, str], dict[str, Any]] = {}
    jobs: list[dict[str, Any]] = []
    for i, ((preset, dtype), model) in enumerate(models.items()):
        engine = _engine(engine_pool, model, dtype, isoexec=True, options=TP_INVARIANT,
                         tensor_parallel_size=2)  # fmt: skip
        verdicts = {
            tp: handshake(contracts[2 * i + j], engine,
                          run_id=f"engine-tp2-{preset}-{dtype}-trainer-tp{tp}")
            for j, tp in enumerate((1, 2))
        }  # fmt: skip
        engine.call("reset_prefix_cache")
        prompts = make_prompts(len(TEMPS), 512, seed=12)
        sampled = engine.generate(
            prompts, [SamplingSpec(max_tokens=6, temperature=t) for t in TEMPS]
        )
        try:
            fingerprint: Any = engine.call("weight_fingerprint")
        except EngineError as e:
            fingerprint = str(e)
        cases[preset, dtype] = {"contracts": contracts[2 * i : 2 * i + 2], "verdicts": verdicts,
                                "sampled": sampled, "fingerprint": fingerprint}  # fmt: skip
        for tp in (1, 2):
            jobs += scoring_jobs(sampled, TEMPS, model=model, dtype=dtype, tp=tp, isoexec=True,
                                 options=opts)  # fmt: skip
    return {"cases": cases, "jobs": jobs, "results": run_tp_jobs(jobs, []),
            "default_contract": contracts[-1]}  # fmt: skip


@pytest.mark.parametrize("trainer_tp", [1, 2])
@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_tp2_engine_matches_and_equals_trainer_bitwise(
    preset: str,
    dtype: str,
    trainer_tp: int,
    request: pytest.FixtureRequest,
    models: dict[tuple[str, str], str],
) -> None:
    tp_run = _run_of(request, preset, dtype)
    case = tp_run["cases"][preset, dtype]
    contract = case["contracts"][trainer_tp - 1]
    assert {s.tp for s in contract.sites} == {"invariant"}
    trainer_verdict, engine_verdict = case["verdicts"][trainer_tp]
    assert trainer_verdict.matched and engine_verdict["outcome"] == "MATCH", trainer_verdict
    model = models[preset, dtype]
    mine = [(j, r) for j, r in zip(tp_run["jobs"], tp_run["results"], strict=True)
            if j["model"] == model and j["tp"] == trainer_tp]  # fmt: skip
    train, eng = aligned_logprobs(case["sampled"], TEMPS, [j for j, _ in mine],
                                  [r for _, r in mine])  # fmt: skip
    assert train.numel() == sum(len(c.token_ids) for c in case["sampled"]) > 0
    assert torch.equal(train, eng), (train - eng).abs().max()


@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_tp2_engine_weight_fingerprint_is_the_checkpoints(
    preset: str, dtype: str, request: pytest.FixtureRequest, models: dict[tuple[str, str], str]
) -> None:
    """Each worker of a TP=2 engine gathers its sharded weights over the TP group and hashes
    the whole checkpoint-named tensors: the checkpoint's own fingerprint, on both workers
    (what the weight gate records after a sync). GDN layers too: their heads (A_log, dt_bias,
    the conv's q/k/v channels, the fused projections' parts) are gathered by vLLM's head
    sharding, for Qwen3-Next's interleaved and Qwen3.5's split projections alike."""
    import json

    from isoexec.contract.architectures import architecture_of
    from isoexec.contract.fingerprint import WeightFingerprint
    from isoexec.megatron.hf_checkpoint import read_hf_state_dict

    got = _run_of(request, preset, dtype)["cases"][preset, dtype]["fingerprint"]
    model = models[preset, dtype]
    # The text model's tensors: a release checkpoint's vision tower and MTP are not served.
    unused = architecture_of(json.loads((Path(model) / "config.json").read_text())).unused_prefixes
    text = {k: v for k, v in read_hf_state_dict(model).items() if not k.startswith(unused)}
    expected = WeightFingerprint.of(text).digest
    assert got == [expected, expected]


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
    trainer = tp_run["default_contract"]  # TP=1, default options
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


@pytest.mark.matrix  # CI time: the pipelined pair below runs the same command at TP=2 x PP=2
def test_pair_checks_a_layout_in_one_command(tmp_path: Path) -> None:
    """`isoexec pair --engine-tp 2 --trainer-tp 2`: vLLM's executor at TP=2, a torchrun trainer
    at TP=2 whose ranks each offer their contract; MATCH and every sampled token bitwise (exit
    0). The isoexec arm only, two engine starts less: that a stock engine at TP=2 differs is
    `test_negative_control_stock_engine_tp2_differs_from_tp1`, and that a pair stock arm's
    comparison fails is shown by the pair runs of integration/test_qwen35_release_pair.py."""
    import json

    from isoexec.tools.cli import main

    out = tmp_path / "pair"
    args = ["pair", "--preset", "tiny-moe", "--engine-tp", "2", "--trainer-tp", "2", "--arms",
            "isoexec", "--num-prompts", "4", "--max-tokens", "6", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    (arm,) = json.loads((out / "results.json").read_text())["arms"]
    assert arm["handshake"].startswith("MATCH")
    assert arm["bitwise_equal"] == arm["tokens"] == 24


def test_pair_with_a_pipelined_trainer(tmp_path: Path) -> None:
    """`isoexec pair --engine-tp 2 --trainer-tp 2 --trainer-pp 2`: a 4-rank torchrun trainer
    (two pipeline stages of two TP ranks, Megatron's schedule) against a TP=2 engine; MATCH
    and every sampled token bitwise."""
    import json

    from isoexec.tools.cli import main

    out = tmp_path / "pair"
    args = ["pair", "--preset", "tiny-dense", "--engine-tp", "2", "--trainer-tp", "2",
            "--trainer-pp", "2", "--arms", "isoexec", "--num-prompts", "4", "--max-tokens", "6",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    (arm,) = json.loads((out / "results.json").read_text())["arms"]
    assert arm["handshake"].startswith("MATCH")
    assert arm["bitwise_equal"] == arm["tokens"] == 24
