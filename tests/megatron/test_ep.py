"""Expert parallelism: EP=2 (a real 2-process gloo world, `torchrun`; Megatron's expert
split and its all-gather token dispatcher over the EP group) scores MoE models bitwise like
EP=1, each rank its own sequences (different token counts, so the exchange pads), with the
same contract; and `train_step` at EP=2 steps the global batch to bitwise EP=1's weights.

The canonical layer sends per-(token, slot) inputs and outputs through the dispatcher (-0.0 in
slots another rank owns, an exact sum) and combines locally in the fixed order
(`isoexec.megatron.expert_parallel`); each expert's rank sums every unit's expert gradient in
the DP tree (`isoexec.megatron.expert_parallel_step`).
Negative controls: stock Megatron (its all-gather dispatcher) at EP=2 differs from EP=1 with
top-4 routing: each rank sums its experts' weighted outputs and the reduce-scatter adds the
ranks' partial sums, another association of the four terms. (With top-2 the stock sum is
a + b either way, equal by commutativity: the control needs k >= 3.) A step as Megatron's DDP
takes it at EP=2 (autograd accumulates the packs, replicated gradients all-reduced, each
expert's gradient summed in its one joint backward) differs from EP=1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.trainer

SEQS_BY_RANK = [
    [[3, 17, 250, 9, 44, 101, 7, 8, 9, 10], [5, 5, 480, 2, 7, 7, 1, 2], [1, 2, 3, 4, 5, 6]],
    [[11, 300, 77, 61, 499, 23, 8, 90, 151, 4, 0, 5, 6, 7, 8], [42, 43, 44], [9, 8, 7, 6]],
]
# Stock Megatron's all-gather dispatcher needs the same token count on every EP rank (it
# all-gathers into equal slices): the native arms score sequences of equal lengths.
NATIVE_SEQS_BY_RANK = [
    SEQS_BY_RANK[0],
    [[11, 300, 77, 61, 499, 23, 8, 90, 151, 4], [42, 43, 44, 1, 0, 9, 9, 3], [9, 8, 7, 6, 5, 4]],
]
TOP4 = {"num_experts_per_tok": 4}
# train_step's global batch (every rank passes all of it): 4 packs of <= 16 tokens, one
# per rank and forward; 3 packs of <= 22 tokens, so one rank's second forward is padding.
TRAIN_SEQS = SEQS_BY_RANK[0] + SEQS_BY_RANK[1]
MAX_TOKENS_FOR_PACKS = {4: 16, 3: 22}
CASES = [("tiny-moe-top4", "float32"), ("tiny-moe-top4", "bfloat16"), ("tiny-gdn", "float32")]
# `policy_train_step` on TRAIN_SEQS: each completion starts at its prompt length; the old
# logprobs are the model's own (ratio exactly 1 before the update).
POLICY = {"prompt_lens": [4, 3, 2, 6, 1, 2], "advantages": [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]}


@pytest.fixture(scope="module")
def ep_results(
    model_factory: Callable[[str, str], str],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[Any, ...], dict[str, Any]]:
    from isoexec.tools.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("ep-models")
    models = {
        ("tiny-moe-top4", dtype): str(
            make_tiny_model("tiny-moe", root / f"top4-{dtype}", dtype=dtype, overrides=TOP4)
        )
        for dtype in ("float32", "bfloat16")
    }
    models["tiny-gdn", "float32"] = model_factory("tiny-gdn", "float32")
    named: dict[tuple[Any, ...], dict[str, Any]] = {}
    for (name, dtype), model in models.items():
        for ep in (1, 2):
            for iso in (True, False):
                if not iso and name == "tiny-gdn":
                    continue  # native GDN layers: TP=1 only, no per-rank GDN mapping needed
                named[name, dtype, iso, ep] = dict(
                    model=model, dtype=dtype, tp=1, ep=ep, isoexec=iso, contract=iso,
                    seqs_by_rank=SEQS_BY_RANK if iso else NATIVE_SEQS_BY_RANK,
                    whole_fingerprint=iso,
                )  # fmt: skip
    top4 = models["tiny-moe-top4", "float32"]
    for dtype, packs in (("float32", 4), ("bfloat16", 4), ("float32", 3)):
        for ep in (1, 2):
            named["train", dtype, packs, ep] = dict(
                model=models["tiny-moe-top4", dtype], dtype=dtype, tp=1, ep=ep, isoexec=True,
                train=True, export_after_step=True, seqs=TRAIN_SEQS,
                max_tokens=MAX_TOKENS_FOR_PACKS[packs],
            )  # fmt: skip
    for ep in (1, 2):  # the clipped policy loss (GRPO's step) through the same EP driver
        named["policy", ep] = dict(
            model=top4, dtype="float32", tp=1, ep=ep, isoexec=True, train=True,
            export_after_step=True, seqs=TRAIN_SEQS, max_tokens=MAX_TOKENS_FOR_PACKS[4],
            policy=POLICY,
        )  # fmt: skip
    named["train-as-ddp"] = dict(
        model=top4, dtype="float32", tp=1, ep=2, isoexec=True, train=True,
        export_after_step=True, seqs=TRAIN_SEQS, max_tokens=MAX_TOKENS_FOR_PACKS[4],
        naive_dp=True,
    )  # fmt: skip
    named["native-train-refused"] = dict(
        model=top4, dtype="float32", tp=1, ep=2, isoexec=False, train=True, expect_error=True,
        seqs=NATIVE_SEQS_BY_RANK[0],
    )  # fmt: skip
    named["unequal-forwards-refused"] = dict(
        model=top4, dtype="float32", tp=1, ep=2, isoexec=True, seqs_by_rank=SEQS_BY_RANK,
        score_max_tokens=12, expect_error=True,
    )  # fmt: skip
    return dict(zip(named, run_tp_jobs(list(named.values()), []), strict=True))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_ep2_logprobs_equal_ep1_on_every_rank(ep_results: dict, name: str, dtype: str) -> None:
    one, two = ep_results[name, dtype, True, 1], ep_results[name, dtype, True, 2]
    assert two["local_experts"] * 2 == one["local_experts"] > 0  # EP=2 holds half the experts
    for rank in (0, 1):
        assert _equal(one["logprobs_by_rank"][rank], two["logprobs_by_rank"][rank]), rank
        assert [t.numel() for t in two["logprobs_by_rank"][rank]] == [
            len(s) - 1 for s in SEQS_BY_RANK[rank]
        ]
    assert one["contract"] == two["contract"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_negative_control_stock_ep2_differs(ep_results: dict, dtype: str) -> None:
    one = ep_results["tiny-moe-top4", dtype, False, 1]["logprobs_by_rank"]
    two = ep_results["tiny-moe-top4", dtype, False, 2]["logprobs_by_rank"]
    differ = sum(int((a != b).sum()) for r in (0, 1) for a, b in zip(one[r], two[r], strict=True))
    print(f"stock Megatron EP=2 vs EP=1 ({dtype}, top-4): {differ} logprobs differ")
    assert differ > 0
    for r in (0, 1):  # ...while it is the same computation up to rounding
        for a, b in zip(one[r], two[r], strict=True):
            assert torch.allclose(a, b, atol=0.05 if dtype == "bfloat16" else 1e-4)


def _weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("dtype", "packs"), [("float32", 4), ("bfloat16", 4), ("float32", 3)])
def test_ep2_train_step_equals_ep1_bitwise(ep_results: dict, dtype: str, packs: int) -> None:
    one, two = ep_results["train", dtype, packs, 1], ep_results["train", dtype, packs, 2]
    experts = [k for k in one["weights_after_step"] if ".mlp.experts." in k]
    assert experts and two["local_experts"] * 2 == one["local_experts"]
    assert _weights_equal(one["weights_after_step"], two["weights_after_step"])
    assert _equal(one["logprobs_after_step"], two["logprobs_after_step"])
    assert one["loss"] == two["loss"]
    before = -torch.cat(one["logprobs"]).double().mean().item()
    after = -torch.cat(one["logprobs_after_step"]).double().mean().item()
    assert after < before  # the step learned


def test_ep2_policy_step_equals_ep1_bitwise(ep_results: dict) -> None:
    """GRPO's clipped step at EP=2 (each rank its packs, each expert's rank summing every
    unit's gradient) steps to EP=1's weights bit for bit; the ratio before it is exactly 1."""
    one, two = ep_results["policy", 1], ep_results["policy", 2]
    assert two["local_experts"] * 2 == one["local_experts"]
    assert one["policy"]["units"] == two["policy"]["units"] == 2.0  # 4 packs over DP=2
    assert _weights_equal(one["weights_after_step"], two["weights_after_step"])
    assert _equal(one["logprobs_after_step"], two["logprobs_after_step"])
    assert one["policy"]["loss"] == two["policy"]["loss"]
    assert one["policy"]["ratio_dev_max"] == 0.0 == two["policy"]["ratio_dev_max"]
    assert not _equal(one["logprobs"], one["logprobs_after_step"])  # it stepped


def test_negative_control_ep2_step_as_ddp_takes_it_differs(ep_results: dict) -> None:
    one = ep_results["train", "float32", 4, 1]["weights_after_step"]
    ddp = ep_results["train-as-ddp"]["weights_after_step"]
    differ = [k for k in one if not torch.equal(one[k], ddp[k])]
    print(f"EP=2 step as DDP takes it vs EP=1: {len(differ)} of {len(one)} tensors differ")
    assert differ
    for k in one:  # ...while it is the same step up to rounding
        assert torch.allclose(one[k], ddp[k], rtol=1e-5, atol=1e-6), k


def test_ep2_native_train_step_and_unequal_forwards_are_refused(ep_results: dict) -> None:
    assert "train_step at EP>1: isoexec models only" in ep_results["native-train-refused"]["error"]
    assert "would run [3, 2] forwards" in ep_results["unequal-forwards-refused"]["error"]


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_the_whole_model_is_handed_out_once_over_the_ep_ranks(
    ep_results: dict, name: str, dtype: str
) -> None:
    """At EP=2 each rank hands out its own experts and rank 0 the replicated rest (the GDN
    hybrid's sparse layers too), each weight once, and the merged fingerprint is EP=1's.
    Negative control: rank 0's export alone (half the experts) is another model."""
    one, two = ep_results[name, dtype, True, 1], ep_results[name, dtype, True, 2]
    assert one["whole_fingerprint"] == two["whole_fingerprint"]
    rank0, rank1 = two["owned_by_rank"]
    assert not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == sorted(one["owned_by_rank"][0])
    assert rank1 and all(".mlp.experts." in n for n in rank1), rank1
    assert two["own_export_fingerprint"] != two["whole_fingerprint"]
