"""The clipped policy loss shared by the GRPO drivers: the ratio's deviation, the clip, and
bad shapes refused."""

from __future__ import annotations

import pytest
import torch

from isoexec.megatron.policy_loss import clipped_policy_loss, per_token


def test_equal_logprobs_give_a_ratio_of_exactly_one() -> None:
    lp = torch.tensor([-1.5, -0.25, -3.0], requires_grad=True)
    pl = clipped_policy_loss(lp, lp.detach().clone(), per_token([2.0], [3]))
    assert pl.ratio_dev_max == 0.0 and pl.ratio_dev_mean == 0.0
    assert float(pl.loss) == -2.0  # -mean(1 * A)
    pl.loss.backward()
    assert torch.equal(lp.grad, torch.full((3,), -2.0 / 3))


def test_the_clip_stops_the_gradient_past_one_plus_epsilon() -> None:
    new = torch.tensor([0.5, -0.5], requires_grad=True)  # ratios e^0.5 and e^-0.5
    pl = clipped_policy_loss(new, torch.zeros(2), torch.tensor([1.0, -1.0]), clip=0.2)
    pl.loss.backward()
    assert torch.equal(new.grad, torch.zeros(2))  # both clipped on the side that stops them
    assert pl.ratio_dev_max == pytest.approx(float(torch.exp(torch.tensor(0.5))) - 1)


def test_per_token_repeats_each_advantage_over_its_completion() -> None:
    assert per_token([1.0, -0.5], [2, 3]).tolist() == [1.0, 1.0, -0.5, -0.5, -0.5]
    with pytest.raises(ValueError):
        per_token([1.0], [2, 3])


def test_shapes_that_differ_are_refused() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        clipped_policy_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3))
