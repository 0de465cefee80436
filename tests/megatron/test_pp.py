"""Pipeline parallelism: PP=2 (a real 2-process gloo world, `torchrun`, Megatron's own 1F1B
schedule) scores and trains Qwen3 dense, MoE and the GDN hybrid bitwise like PP=1, and the two
stages together declare the PP=1 contract.

Why PP is equal by construction: a stage runs whole layers, and what crosses a stage boundary
is the hidden state itself (a p2p copy), forward and backward. So the check here is that the
wiring keeps it so (layer split, per-stage weight load and export, schedule, contract gathered
over stages); stock Megatron at PP=2 is bitwise PP=1 as well (shown below) — the case is
trivially equal, and there is no stock difference to control. What must still be refused is a
changed site on one stage: the contract gathered over stages names it
(`integration/test_engine_tp.py`, the 4-rank handshake).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.trainer

SEQS = [
    [3, 17, 250, 9, 44, 101, 7, 8, 9, 10],
    [5, 5, 480, 2, 7, 7, 1, 2],
    [11, 300, 77, 61, 499, 23, 8, 90, 151, 4, 0, 5],
    [6, 7, 8, 9, 10, 11, 12, 13, 14],
]
MAX_TOKENS = 20  # 3 packs: train_step's units, each one run of the schedule

CASES = [("tiny-dense", "float32"), ("tiny-dense", "bfloat16"), ("tiny-moe", "float32"),
         ("tiny-moe", "bfloat16"), ("tiny-gdn", "float32")]  # fmt: skip


@pytest.fixture(scope="module")
def pp_results(
    model_factory: Callable[[str, str], str], run_tp_jobs: Callable[..., list[dict[str, Any]]]
) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    named: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for preset, dtype in CASES:
        model = model_factory(preset, dtype)
        for pp in (1, 2):
            named[preset, dtype, "iso", pp] = dict(
                model=model, dtype=dtype, tp=1, pp=pp, isoexec=True, contract=True,
                train=dtype == "float32", export_after_step=True, max_tokens=MAX_TOKENS,
                whole_fingerprint=True,
            )  # fmt: skip
            if preset == "tiny-dense":
                named[preset, dtype, "native", pp] = dict(
                    model=model, dtype=dtype, tp=1, pp=pp, isoexec=False
                )
    # PP=1 jobs run in the same 2-rank world as data-parallel replicas.
    return dict(zip(named, run_tp_jobs(list(named.values()), SEQS), strict=True))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_pp2_logprobs_and_contract_equal_pp1(pp_results: dict, preset: str, dtype: str) -> None:
    one, two = pp_results[preset, dtype, "iso", 1], pp_results[preset, dtype, "iso", 2]
    assert _equal(one["logprobs"], two["logprobs"])
    assert [lp.numel() for lp in two["logprobs"]] == [len(s) - 1 for s in SEQS]
    assert one["contract"] == two["contract"]  # the stages together declare PP=1's sites
    # Rank 0 of the PP=2 world is the first stage and holds the first half of the layers only.
    layers = one["stage"][3]
    assert one["stage"] == (0, 1, list(range(layers)), layers)
    assert two["stage"] == (0, 2, list(range(layers // 2)), layers // 2)


@pytest.mark.parametrize(("preset", "dtype"), [c for c in CASES if c[1] == "float32"])
def test_pp2_train_step_equals_pp1_bitwise(pp_results: dict, preset: str, dtype: str) -> None:
    one, two = pp_results[preset, dtype, "iso", 1], pp_results[preset, dtype, "iso", 2]
    w1, w2 = one["weights_after_step"], two["weights_after_step"]
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert _equal(one["logprobs_after_step"], two["logprobs_after_step"])
    assert not _equal(one["logprobs"], one["logprobs_after_step"])  # the step changed the model
    assert one["loss"] == pytest.approx(two["loss"], abs=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stock_megatron_pp2_is_pp1_too(pp_results: dict, dtype: str) -> None:
    """Why PP has no stock negative control: native Megatron at PP=2 is PP=1 bit for bit."""
    one = pp_results["tiny-dense", dtype, "native", 1]["logprobs"]
    two = pp_results["tiny-dense", dtype, "native", 2]["logprobs"]
    assert _equal(one, two)


@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_the_whole_model_is_handed_out_once_over_the_stages(
    pp_results: dict, preset: str, dtype: str
) -> None:
    """At PP=2 each stage hands out its own weights (`whole_model.owned_exports`: what a Ray
    weight sync publishes per rank), each weight by one rank, and the merged fingerprint is
    PP=1's. Negative control: rank 0's export alone (a sync from rank 0 only) is another model."""
    one, two = pp_results[preset, dtype, "iso", 1], pp_results[preset, dtype, "iso", 2]
    assert one["whole_fingerprint"] == two["whole_fingerprint"]
    assert two["own_export_fingerprint"] != two["whole_fingerprint"]
    stage0, stage1 = two["owned_by_rank"]
    assert stage0 and stage1 and not set(stage0) & set(stage1)
    assert sorted(stage0 + stage1) == sorted(n for part in one["owned_by_rank"] for n in part)
    assert one["owned_by_rank"][1] == []  # PP=1 (two DP replicas): rank 0 owns everything
