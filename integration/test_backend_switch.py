"""The kernel backend is one option on both sides, and the contract tells backends apart.

`IsoExecOptions(backend="triton")` makes every site of the trainer and of the engine run the
Triton kernels (here on CPU under TRITON_INTERPRET=1, which proves the plumbing and the
kernels' structure, not GPU bits). A Triton trainer and a torch engine are refused by the
handshake, naming the backend; a Triton trainer and a Triton engine MATCH and their logprobs
are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _pairing import aligned_logprobs, scoring_jobs

from isoexec.contract.contract import Contract
from isoexec.contract.options import IsoExecOptions
from isoexec.ops.capture_guard import CAPTURE_GUARD_ENV
from isoexec.tools.pair import handshake
from isoexec.vllm.engine_process import SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

TRITON = IsoExecOptions(backend="triton")
INTERPRET = {"TRITON_INTERPRET": "1"}
TEMPS = [1.0, 0.7, 1.0]


@pytest.fixture(scope="module")
def triton_run(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> dict[str, Any]:
    """A Triton engine samples; a Triton trainer (own process, interpreter) scores it."""
    model = model_factory("tiny-dense", "float32")
    engine = engine_pool(
        model=model, dtype="float32", isoexec=True, options=TRITON,
        # The capture guard on: no captured op syncs with the host (test_capture_guard_engines).
        extra_env=(*INTERPRET.items(), (CAPTURE_GUARD_ENV, "1")),
        # vLLM's warm-up forward has max_num_batched_tokens rows: keep it small, interpreted.
        max_model_len=128, max_num_batched_tokens=32, kv_cache_bytes=8 * 2**20,
    )  # fmt: skip
    g = torch.Generator().manual_seed(21)
    # Short prompts (interpreted kernels are slow); the 40-token one is prefilled in 2 chunks.
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 40, 11)]
    specs = [SamplingSpec(max_tokens=4, temperature=t) for t in TEMPS]
    sampled = engine.generate(prompts, specs)
    jobs = scoring_jobs(
        sampled, TEMPS, model=model, dtype="float32", tp=1, isoexec=True,
        options=TRITON.to_dict(), contract=True,
    )  # fmt: skip
    results = run_tp_jobs(jobs, [], nproc=1, env=INTERPRET)
    return {"engine": engine, "model": model, "sampled": sampled, "jobs": jobs, "results": results}


def test_triton_trainer_contract_is_all_triton(triton_run: dict[str, Any]) -> None:
    contract = Contract.from_bytes(triton_run["results"][0]["contract"])
    assert {s.impl.backend for s in contract.sites} == {"triton"}
    assert contract.device.triton is not None  # the Triton version is part of the identity


def test_triton_trainer_refused_by_torch_engine(
    triton_run: dict[str, Any], engine_pool: Callable[..., Any]
) -> None:
    torch_engine = engine_pool(  # the torch engine integration/test_trainer_engine.py uses
        model=triton_run["model"], dtype="float32", isoexec=True, max_num_batched_tokens=64
    )
    contract = Contract.from_bytes(triton_run["results"][0]["contract"])
    trainer_verdict, engine_verdict = handshake(contract, torch_engine, run_id="triton-vs-torch")
    assert engine_verdict["outcome"] == "MISMATCH" and not trainer_verdict.matched
    assert "triton" in "\n".join(trainer_verdict.diff), trainer_verdict.diff


def test_triton_trainer_equals_triton_engine_bitwise(triton_run: dict[str, Any]) -> None:
    contract = Contract.from_bytes(triton_run["results"][0]["contract"])
    trainer_verdict, engine_verdict = handshake(
        contract, triton_run["engine"], run_id="triton-both"
    )
    assert trainer_verdict.matched and engine_verdict["outcome"] == "MATCH", trainer_verdict
    r = triton_run
    t, e = aligned_logprobs(r["sampled"], TEMPS, r["jobs"], r["results"])
    assert t.numel() == 4 * len(TEMPS)
    assert torch.equal(t, e), (t - e).abs().max()


@pytest.mark.matrix
def test_triton_tp_invariant_engine_tp2_equals_trainer_tp2_bitwise(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    """Triton with `tp_invariant` at TP=2 on both sides (vLLM's executor, a torchrun trainer;
    both under the interpreter): MATCH, and every sampled logprob bitwise the trainer's. The
    Triton leaves are gathered in rank order and summed in the shared fixed tree on both."""
    options = IsoExecOptions(backend="triton", tp_invariant=True)
    model = model_factory("tiny-dense", "float32")
    engine = engine_pool(
        model=model, dtype="float32", isoexec=True, options=options, tensor_parallel_size=2,
        enforce_eager=True, extra_env=tuple(INTERPRET.items()),
        max_model_len=128, max_num_batched_tokens=32, kv_cache_bytes=8 * 2**20,
    )  # fmt: skip
    g = torch.Generator().manual_seed(22)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 40, 11)]
    sampled = engine.generate(prompts, [SamplingSpec(max_tokens=4, temperature=t) for t in TEMPS])
    jobs = scoring_jobs(
        sampled, TEMPS, model=model, dtype="float32", tp=2, isoexec=True,
        options=options.to_dict(), contract=True,
    )  # fmt: skip
    results = run_tp_jobs(jobs, [], nproc=2, env=INTERPRET)
    contract = Contract.from_bytes(results[0]["contract"])
    assert {s.tp for s in contract.sites} == {"invariant"}
    trainer_verdict, engine_verdict = handshake(contract, engine, run_id="triton-tp2")
    assert trainer_verdict.matched and engine_verdict["outcome"] == "MATCH", trainer_verdict
    t, e = aligned_logprobs(sampled, TEMPS, jobs, results)
    assert t.numel() == 4 * len(TEMPS)
    assert torch.equal(t, e), (t - e).abs().max()
