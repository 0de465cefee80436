"""The clipped policy-gradient loss (PPO's surrogate, as GRPO uses it) against the rollout's
logprobs, with the importance ratio's deviation from 1 that IsoExec exists to make exactly 0.

One definition for every driver (the single-process example, the Ray trainer actor): the
ratio's deviation is computed from the same tensor the loss uses, before the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor  # scalar, with the autograd graph
    ratio_dev_max: float  # max |π_train/π_rollout - 1| over the tokens
    ratio_dev_mean: float


def per_token(advantages: Sequence[float], lengths: Sequence[int]) -> torch.Tensor:
    """Each sequence's advantage repeated over its completion tokens."""
    return torch.cat([torch.full((n,), float(a)) for a, n in zip(advantages, lengths, strict=True)])


def clipped_policy_loss(
    new: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, clip: float = 0.2
) -> PolicyLoss:
    """-mean(min(r·A, clip(r, 1-ε, 1+ε)·A)) with r = exp(new - behaviour), per token."""
    if not new.shape == behaviour.shape == advantages.shape:
        shapes = [tuple(t.shape) for t in (new, behaviour, advantages)]
        raise ValueError(f"shapes differ: new, behaviour, advantages {shapes}")
    ratio = torch.exp(new - behaviour.to(new.dtype))
    adv = advantages.to(new.dtype)
    dev = (ratio.detach() - 1).abs()
    loss = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
    return PolicyLoss(loss, float(dev.max()), float(dev.mean()))


def policy_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor
) -> None:
    """Backward, then what Megatron's training loop would reduce before the step (the q/k norm
    gradients over TP: each rank holds a partial sum), then the optimizer step. Without the
    reduction the TP ranks' copies of the q/k norms drift apart after one step, and the live
    model no longer equals its export (the numeric canary finds it)."""
    from isoexec.megatron.scoring import sum_qk_norm_grads_over_tp

    loss.backward()
    sum_qk_norm_grads_over_tp(model)
    optimizer.step()


__all__ = ["PolicyLoss", "clipped_policy_loss", "per_token", "policy_step"]
