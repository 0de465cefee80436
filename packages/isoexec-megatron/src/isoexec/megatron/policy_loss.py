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
    terms, ratio = _surrogate(new, behaviour, advantages, clip)
    dev = (ratio.detach() - 1).abs()
    return PolicyLoss(-terms.mean(), float(dev.max()), float(dev.mean()))


def _surrogate(
    new: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: min(r·A, clip(r, 1-ε, 1+ε)·A), and the ratio r = exp(new - behaviour)."""
    ratio = torch.exp(new - behaviour.to(new.dtype))
    adv = advantages.to(new.dtype)
    return torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv), ratio


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


def policy_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    old: Sequence[Sequence[float]],
    advantages: Sequence[float],
    *,
    temperature: float = 1.0,
    clip: float = 0.2,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """One clipped policy-gradient step on the global batch (every DP rank passes all of it),
    split over data parallelism: the batch's packs of <= `max_tokens` tokens are the units,
    each DP rank computes its contiguous block of them, and the unit gradients of
    `-sum(min(r·A, clip(r)·A)) / tokens` are summed in `grad_tree`'s fixed tree, finished over
    DP. So DP ranks share the work, and the step is bitwise the same at DP=1, 2, 4 (fp32, the
    same `max_tokens`), as `scoring.train_step`'s. Returns the loss and the ratio's deviation
    over the whole batch, and `units`: the packs this rank computed. IsoExec models at PP=1
    and EP=1 only (elsewhere each DP rank steps on
    the whole batch: `policy_step`)."""
    from isoexec.megatron.grad_tree import GradTree, finish_over_dp, rank_units
    from isoexec.megatron.packing import split_into_packs
    from isoexec.megatron.scoring import packed_logprobs, sum_qk_norm_grads_over_tp
    from megatron.core import parallel_state as ps

    lens = [len(o) for o in old]
    total = sum(lens)
    seqs = [torch.tensor(list(s), dtype=torch.int64) for s in sequences]
    parallel = ps.model_parallel_is_initialized()
    dp = ps.get_data_parallel_world_size() if parallel else 1
    rank = ps.get_data_parallel_rank() if parallel else 0
    params = [p for p in model.parameters() if p.requires_grad]
    packs = split_into_packs([int(s.numel()) for s in seqs], max_tokens)
    tree = GradTree(params)
    loss_sum, dev_max, dev_sum, computed = 0.0, 0.0, 0.0, 0
    optimizer.zero_grad(set_to_none=True)
    model.train()
    for unit in rank_units(len(packs), dp, rank):
        if unit >= len(packs):  # padding to a power of two: an empty unit
            tree.push(None)
            continue
        idx = packs[unit]
        lps = packed_logprobs(model, [seqs[i] for i in idx], temperature)
        new = torch.cat([lps[j][prompt_lens[i] - 1 :] for j, i in enumerate(idx)])
        behaviour = torch.tensor([x for i in idx for x in old[i]], dtype=new.dtype)
        adv = per_token([advantages[i] for i in idx], [lens[i] for i in idx])
        terms, ratio = _surrogate(new, behaviour, adv, clip)
        loss = -terms.sum() / total
        tree.push(torch.autograd.grad(loss, params, allow_unused=True))
        computed += 1
        dev = (ratio.detach() - 1).abs()
        loss_sum += float(loss.detach())
        dev_max, dev_sum = max(dev_max, float(dev.max())), dev_sum + float(dev.sum())
    group = ps.get_data_parallel_group() if dp > 1 else None
    for p, g in zip(params, finish_over_dp(tree.result(), group, dp), strict=True):
        p.grad = g
    stats = torch.tensor([loss_sum, dev_sum], dtype=torch.float64)
    most = torch.tensor([dev_max], dtype=torch.float64)
    if dp > 1:
        torch.distributed.all_reduce(stats, group=group)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=group)
    sum_qk_norm_grads_over_tp(model)
    optimizer.step()
    model.eval()
    return {"loss": float(stats[0]), "ratio_dev_max": float(most[0]),
            "ratio_dev_mean": float(stats[1]) / total, "units": float(computed)}  # fmt: skip


__all__ = ["PolicyLoss", "clipped_policy_loss", "per_token", "policy_step", "policy_train_step"]
