"""Data parallelism in `train_step`: DP=2 (a real 2-process gloo world, `torchrun`) steps the
same global batch to bitwise the same fp32 weights as DP=1.

Each DP rank computes its contiguous block of the batch's packs and the pack gradients are
summed in one fixed tree (`isoexec.megatron.grad_tree`), finished over DP by an all-gather in
rank order. Negative control, built in (an addition order, no BLAS involved): the same step as
a DDP all-reduce does it (each rank accumulates its packs, the sums are all-reduced) gives
DP=2 other bits than DP=1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.trainer

# 6 sequences in packs of <= 20 tokens: 4 packs, so each DP rank has 2.
SEQS = [
    [3, 17, 250, 9, 44, 101, 7, 8, 9, 10],
    [5, 5, 480, 2, 7, 7, 1, 2],
    [11, 300, 77, 61, 499, 23, 8, 90, 151, 4, 0, 5],
    [6, 7, 8, 9, 10, 11, 12, 13, 14],
    [100, 200, 300, 400, 500, 1, 2, 3, 4, 5, 6],
    [42, 43, 44, 45, 46, 47, 48, 49],
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def dp_results(
    model_factory: Callable[[str, str], str], run_tp_jobs: Callable[..., list[dict[str, Any]]]
) -> dict[tuple[str, int, bool], dict[str, Any]]:
    from isoexec.megatron.packing import split_into_packs as _packs

    assert len(_packs([len(s) for s in SEQS], MAX_TOKENS)) == 4
    out: dict[tuple[str, int, bool], dict[str, Any]] = {}
    for dp in (1, 2):
        keys, jobs = [], []
        for preset in ("tiny-dense", "tiny-moe"):
            for naive in (False, True):
                keys.append((preset, dp, naive))
                jobs.append(dict(
                    model=model_factory(preset, "float32"), dtype="float32", tp=1, isoexec=True,
                    train=True, export_after_step=True, max_tokens=MAX_TOKENS, naive_dp=naive,
                ))  # fmt: skip
        out.update(zip(keys, run_tp_jobs(jobs, SEQS, nproc=dp), strict=True))
    return out


# The policy step (GRPO's clipped loss, `policy_train_step`) on the same batch: each sequence's
# completion starts at its prompt length; the behaviour logprobs are the model's own (ratio 1).
POLICY = {"prompt_lens": [4, 3, 5, 4, 6, 3], "advantages": [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]}


@pytest.fixture(scope="module")
def policy_results(
    model_factory: Callable[[str, str], str], run_tp_jobs: Callable[..., list[dict[str, Any]]]
) -> dict[int, dict[str, Any]]:
    job = dict(
        model=model_factory("tiny-dense", "float32"), dtype="float32", tp=1, isoexec=True,
        train=True, export_after_step=True, max_tokens=MAX_TOKENS, policy=POLICY,
    )  # fmt: skip
    out: dict[Any, dict[str, Any]] = {dp: run_tp_jobs([job], SEQS, nproc=dp)[0] for dp in (1, 2)}
    # PP=2 x DP=2: four ranks, each pipeline stage's DP pair splits the packs
    staged = [{**job, "pp": 2}, {**{k: v for k, v in job.items() if k != "policy"}, "pp": 2}]
    out["pp2", "policy"], out["pp2", "train"] = run_tp_jobs(staged, SEQS, nproc=4)
    return out


def test_the_policy_step_splits_over_dp_and_equals_dp1_bitwise(policy_results: dict) -> None:
    """DP=2 ranks each compute half the packs (2 of 4) of the clipped policy loss, and the
    step is bitwise DP=1's; the ratio before the update is exactly 1 (old = the model's own)."""
    one, two = policy_results[1], policy_results[2]
    assert (one["policy"]["units"], two["policy"]["units"]) == (4.0, 2.0)
    assert _weights_equal(one["weights_after_step"], two["weights_after_step"])
    assert one["policy"]["loss"] == pytest.approx(two["policy"]["loss"], abs=1e-7)
    assert one["policy"]["ratio_dev_max"] == 0.0 == two["policy"]["ratio_dev_max"]
    before = torch.cat(one["logprobs"])
    assert not torch.equal(before, torch.cat(one["logprobs_after_step"]))  # it stepped


def test_at_pp2_the_dp_ranks_split_the_step_and_equal_dp1_bitwise(
    policy_results: dict, dp_results: dict
) -> None:
    """PP=2 x DP=2 (four ranks): each stage's two DP ranks compute 2 of the 4 packs through
    Megatron's pipeline schedule, and both steps (the policy step and `train_step`'s) are
    bitwise DP=1's at PP=1."""
    one, staged = policy_results[1], policy_results["pp2", "policy"]
    assert staged["stage"][:2] == (0, 2) and staged["policy"]["units"] == 2.0
    assert _weights_equal(one["weights_after_step"], staged["weights_after_step"])
    assert one["policy"]["loss"] == staged["policy"]["loss"]
    assert staged["policy"]["ratio_dev_max"] == 0.0
    train_one, train_staged = dp_results["tiny-dense", 1, False], policy_results["pp2", "train"]
    assert _weights_equal(train_one["weights_after_step"], train_staged["weights_after_step"])
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            train_one["logprobs_after_step"], train_staged["logprobs_after_step"], strict=True
        )
    )


def _weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_dp2_step_equals_dp1_step_bitwise(dp_results: dict, preset: str) -> None:
    one, two = dp_results[preset, 1, False], dp_results[preset, 2, False]
    assert _weights_equal(one["weights_after_step"], two["weights_after_step"])
    assert all(
        torch.equal(a, b)
        for a, b in zip(one["logprobs_after_step"], two["logprobs_after_step"], strict=True)
    )
    assert one["loss"] == pytest.approx(two["loss"], abs=1e-6)
    before = -torch.cat(one["logprobs"]).double().mean().item()
    after = -torch.cat(one["logprobs_after_step"]).double().mean().item()
    assert after < before  # the step learned


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_negative_control_all_reduced_dp_differs(dp_results: dict, preset: str) -> None:
    one, two = dp_results[preset, 1, True], dp_results[preset, 2, True]
    assert not _weights_equal(one["weights_after_step"], two["weights_after_step"])
    # ...while it is the same step up to rounding.
    for k, v in one["weights_after_step"].items():
        assert torch.allclose(v, two["weights_after_step"][k], rtol=1e-5, atol=1e-6), k


def test_grad_tree_pads_the_same_at_every_dp() -> None:
    from isoexec.megatron.grad_tree import padded_units, rank_units

    assert [padded_units(n, 1) for n in (1, 3, 4, 5)] == [1, 4, 4, 8]
    assert [padded_units(n, 2) for n in (1, 3, 4, 5)] == [2, 4, 4, 8]
    assert list(rank_units(3, 2, 1)) == [2, 3]
    with pytest.raises(ValueError, match="power of two"):
        padded_units(4, 3)
