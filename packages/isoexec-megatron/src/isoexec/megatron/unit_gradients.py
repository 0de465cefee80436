"""The gradient of a global batch cut into units, for any loss on the units' logprobs: the same
bits at every DP degree, at PP>1 and at EP>1.

One driver for every step the trainer takes (`scoring.train_step`'s mean negative logprob,
`policy_loss.policy_train_step`'s clipped surrogate), so that a new loss does not need its own
copy of the parallel plumbing. The units are the batch's packs, which do not depend on the
layout. Each DP rank computes its contiguous block of them (`grad_tree.rank_units`), one
packed forward and backward per unit:
- PP=1: the forward keeps the graph and `torch.autograd.grad` takes the unit's gradients;
- PP>1: through Megatron's pipeline schedule, the loss computed on the last stage, the
  gradients read from `.grad` on every stage (a stage's parameters are its own);
- EP>1: `expert_parallel_step` (each source rank's tokens against their own copy of the
  experts, so an expert's rank gets every unit's gradient separately).
The unit gradients are summed in `grad_tree`'s fixed tree and the tree is finished over DP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from isoexec.megatron.grad_tree import GradTree, finish_over_dp, rank_units
from isoexec.megatron.packing import Pack, pack_sequences

# (global unit index, the unit's per-sequence logprobs, graph kept) -> (the unit's scalar loss,
# floats to report for it). Losses of the units add up to the step's loss.
UnitLoss = Callable[[int, list[torch.Tensor]], tuple[torch.Tensor, tuple[float, ...]]]


@dataclass(frozen=True)
class UnitGradients:
    grads: list[torch.Tensor]  # each parameter's gradient over the whole batch
    loss_sum: float  # the losses of this DP rank's units
    reports: dict[int, tuple[float, ...]]  # unit -> its report, for this DP rank's units


def unit_gradients(
    model: torch.nn.Module,
    params: Sequence[torch.nn.Parameter],
    units: Sequence[list[torch.Tensor]],
    unit_loss: UnitLoss,
    *,
    temperature: float = 1.0,
) -> UnitGradients:
    """The gradients of `sum(unit_loss(u))` over every unit, on every rank of the world.

    Every rank passes the whole batch (`units`); each runs its DP block. At PP>1 every stage
    returns the last stage's losses and reports."""
    from isoexec.megatron.expert_parallel_step import expert_parallel_grads
    from isoexec.megatron.packed_forward import (
        model_is_moe,
        pack_logprobs,
        packed_logprobs,
        pipelined,
    )
    from megatron.core import parallel_state as ps

    params = list(params)
    parallel = ps.model_parallel_is_initialized()
    dp = ps.get_data_parallel_world_size() if parallel else 1
    rank = ps.get_data_parallel_rank() if parallel else 0

    def loss_of(unit: int) -> tuple[torch.Tensor, tuple[float, ...]]:
        return unit_loss(unit, packed_logprobs(model, units[unit], temperature))

    if parallel and ps.get_expert_model_parallel_world_size() > 1 and model_is_moe(model):
        grads, done = expert_parallel_grads(model, params, len(units), loss_of)
        return UnitGradients(grads, sum(loss for loss, _ in done.values()),
                             {u: report for u, (_, report) in done.items()})  # fmt: skip

    tree = GradTree(params)
    loss_sum, reports = 0.0, {}
    for unit in rank_units(len(units), dp, rank):
        if unit >= len(units):  # padding to a power of two: an empty unit
            tree.push(None)
            continue
        if pipelined(model):
            pack = pack_sequences(model, units[unit], None)

            def last(logits: torch.Tensor, u: int = unit, p: Pack = pack) -> tuple[Any, Any]:
                loss_t, report = unit_loss(u, pack_logprobs(model, p, logits, temperature))
                return loss_t, (float(loss_t.detach()), report)

            grads, (loss, report) = _pipeline_unit_grads(model, params, pack, last)
        else:
            loss_t, report = loss_of(unit)
            grads = list(torch.autograd.grad(loss_t, params, allow_unused=True))
            loss = float(loss_t.detach())
        tree.push(grads)
        loss_sum += loss
        reports[unit] = report
    group = ps.get_data_parallel_group() if dp > 1 else None
    return UnitGradients(finish_over_dp(tree.result(), group, dp), loss_sum, reports)


def _pipeline_unit_grads(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    pack: Pack,
    last: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
) -> tuple[list[torch.Tensor | None], Any]:
    """One unit's gradients at PP>1 and the last stage's data (on every stage): forward and
    backward through Megatron's schedule, the gradients read from `.grad` (cleared first)."""
    from isoexec.megatron.pipeline import broadcast_from_last_stage, run_schedule

    for p in params:
        p.grad = None
    data = broadcast_from_last_stage(
        run_schedule(model, pack.inputs, pack.length, last, forward_only=False)
    )
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads, data


__all__ = ["UnitGradients", "UnitLoss", "unit_gradients"]
