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
    """One clipped policy-gradient step on the global batch (every rank passes all of it),
    split over data parallelism: the batch's packs of <= `max_tokens` tokens are the units,
    each DP rank computes its contiguous block of them, and the unit gradients of
    `-sum(min(r·A, clip(r)·A)) / tokens` are summed in `grad_tree`'s fixed tree, finished over
    DP (`unit_gradients`: also at PP>1, and at EP>1 with the EP group spanning DP). So DP
    ranks share the work, and the step is bitwise the same at DP=1, 2, 4 (the same
    `max_tokens`), as `scoring.train_step`'s. Returns the loss and the ratio's deviation over
    the whole batch, and `units`: the packs this rank computed. IsoExec models only (a native
    model steps with `policy_step`)."""
    from isoexec.megatron.logprobs import is_isoexec
    from isoexec.megatron.packing import split_into_packs
    from isoexec.megatron.scoring import sum_qk_norm_grads_over_tp
    from isoexec.megatron.unit_gradients import unit_gradients
    from megatron.core import parallel_state as ps

    if not is_isoexec(model):
        raise TypeError("policy_train_step runs the canonical ops: an isoexec model only")
    if not len(sequences) == len(prompt_lens) == len(old) == len(advantages):
        counts = [len(sequences), len(prompt_lens), len(old), len(advantages)]
        raise ValueError(f"sequences, prompt_lens, old, advantages: counts differ {counts}")
    lens = [len(o) for o in old]
    total = sum(lens)
    seqs = [torch.tensor(list(s), dtype=torch.int64) for s in sequences]
    # checked on every rank before any forward: a stage that raised alone would hang the rest
    wrong = [i for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True))
             if not 1 <= n <= s.numel() or lens[i] != s.numel() - n]  # fmt: skip
    if wrong:
        raise ValueError(
            f"sequences {wrong}: old[i] must hold one logprob per token after prompt_lens[i] "
            "(and 1 <= prompt_lens[i] <= len(sequences[i]))"
        )
    if total == 0:
        raise ValueError("policy_train_step needs at least one completion token")
    packs = split_into_packs([int(s.numel()) for s in seqs], max_tokens)

    def unit_loss(unit: int, lps: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[float, ...]]:
        idx = packs[unit]
        new = torch.cat([lps[j][prompt_lens[i] - 1 :] for j, i in enumerate(idx)])
        behaviour = torch.tensor([x for i in idx for x in old[i]], dtype=new.dtype)
        adv = per_token([advantages[i] for i in idx], [lens[i] for i in idx])
        terms, ratio = _surrogate(new, behaviour, adv, clip)
        dev = (ratio.detach() - 1).abs()
        return -terms.sum() / total, (float(dev.sum()), float(dev.max()) if dev.numel() else 0.0)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    model.train()
    step = unit_gradients(
        model, params, [[seqs[i] for i in pack] for pack in packs], unit_loss,
        temperature=temperature,
    )  # fmt: skip
    for p, g in zip(params, step.grads, strict=True):
        p.grad = g
    reports = step.reports.values()
    stats = torch.tensor([step.loss_sum, sum(r[0] for r in reports)], dtype=torch.float64)
    most = torch.tensor([max((r[1] for r in reports), default=0.0)], dtype=torch.float64)
    parallel = ps.model_parallel_is_initialized()
    if parallel and ps.get_data_parallel_world_size() > 1:
        group = ps.get_data_parallel_group()
        dev = params[0].device if params else None  # NCCL reduces CUDA tensors only
        stats, most = stats.to(dev), most.to(dev)
        torch.distributed.all_reduce(stats, group=group)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=group)
    sum_qk_norm_grads_over_tp(model)
    optimizer.step()
    model.eval()
    units = float(len(step.reports))
    return {"loss": float(stats[0]), "ratio_dev_max": float(most[0]),
            "ratio_dev_mean": float(stats[1]) / total, "units": units}  # fmt: skip


__all__ = ["PolicyLoss", "clipped_policy_loss", "per_token", "policy_step", "policy_train_step"]
