"""A step's gradients at EP>1 (`unit_gradients`): the same bits as EP=1 on the same batch.

At EP=1 a unit's (pack's) expert gradients come from that unit's tokens only, and the units
are summed in `grad_tree`'s fixed tree. At EP>1 each forward is a collective: DP rank r runs
its unit while the other EP ranks run theirs, and the experts a rank holds see every rank's
tokens. `expert_parallel.dispatched_expert_outputs` runs each source rank's tokens against
their own stacked copy of the weights (`ExpertBlocks`), so autograd returns one expert gradient
per source unit; the rank holding an expert thus gets the gradient of *every* global unit for
it, and sums them in the global unit order with the same tree EP=1 uses. The replicated
(non-expert) parameters take the usual path: this rank's units, the tree finished over DP.

Scope: TP=1, PP=1, and the EP group spanning the DP group (expert data parallelism 1, each
expert on one rank); anything else is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from isoexec.megatron.grad_tree import GradTree, finish_over_dp, padded_units, rank_units

# global unit -> (its scalar loss, floats to report for it)
UnitLossOf = Callable[[int], tuple[torch.Tensor, tuple[float, ...]]]


def _moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from isoexec.megatron.moe import IsoMoELayer

    return [m for m in model.modules() if isinstance(m, IsoMoELayer)]


def _expert_params(layer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """One MoE layer's local expert weights in the stacked order: every fc1, then every fc2."""
    experts = layer.experts.local_experts  # type: ignore[union-attr]
    return [e.linear_fc1.weight for e in experts] + [e.linear_fc2.weight for e in experts]


def check_expert_parallel_step(model: torch.nn.Module) -> None:
    """Refuse a layout this step cannot make bitwise EP=1's, before any forward."""
    from megatron.core import parallel_state as ps

    problems = []
    if ps.get_tensor_model_parallel_world_size() != 1:
        problems.append(f"TP={ps.get_tensor_model_parallel_world_size()}")
    if ps.get_pipeline_model_parallel_world_size() != 1:
        problems.append(f"PP={ps.get_pipeline_model_parallel_world_size()}")
    if ps.get_expert_data_parallel_world_size() != 1:
        problems.append(f"expert data parallelism {ps.get_expert_data_parallel_world_size()}")
    if ps.get_data_parallel_rank() != ps.get_expert_model_parallel_rank():
        problems.append("EP ranks that are not the DP ranks")
    if problems:
        got = ", ".join(problems)
        raise NotImplementedError(
            "train_step at EP>1 needs TP=1, PP=1 and the EP group spanning the DP group (each "
            f"expert on one rank, so its rank sums every unit's gradient); got {got}"
        )


def expert_parallel_grads(
    model: torch.nn.Module,
    params: Sequence[torch.nn.Parameter],
    num_units: int,
    loss_of: UnitLossOf,
) -> tuple[list[torch.Tensor], dict[int, tuple[float, tuple[float, ...]]]]:
    """(gradient of every parameter in `params`, {unit: (loss, report)} for this rank's units)
    for the global batch cut into `num_units` units (the packs), the loss being the sum of
    `loss_of(unit)` over every unit (`unit_gradients`).

    Every rank runs as many forwards: its block of the padded units (`grad_tree.rank_units`),
    a padding unit as a forward of unit 0 whose gradients are dropped, since every MoE layer
    forward and backward is a collective over the EP group.
    """
    from megatron.core import parallel_state as ps

    check_expert_parallel_step(model)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    layers = _moe_layers(model)
    expert_params = [p for layer in layers for p in _expert_params(layer)]
    expert_ids = {id(p) for p in expert_params}
    dense = [p for p in params if id(p) not in expert_ids]
    dense_tree = GradTree(dense)
    by_unit: dict[int, list[torch.Tensor]] = {}  # global unit -> this rank's expert grads
    done: dict[int, tuple[float, tuple[float, ...]]] = {}
    for step, unit in enumerate(rank_units(num_units, dp, rank)):
        padding = unit >= num_units
        loss, report = loss_of(0 if padding else unit)
        if padding:
            loss = loss * 0.0
        blocks = [layer.expert_blocks.weights for layer in layers]
        if any(len(b) != dp for b in blocks):
            raise RuntimeError(f"expected {dp} expert blocks per MoE layer, got {blocks!r}")
        block_tensors = [w for b in blocks for pair in b for w in pair]
        grads = torch.autograd.grad(loss, [*dense, *block_tensors], allow_unused=True)
        dense_tree.push(None if padding else grads[: len(dense)])
        block_grads = iter(grads[len(dense) :])
        per_src: list[list[torch.Tensor | None]] = [[] for _ in range(dp)]
        for layer_blocks in blocks:
            for src in range(len(layer_blocks)):
                g13, g2 = next(block_grads), next(block_grads)
                per_src[src].append(g13)
                per_src[src].append(g2)
        for src in range(dp):
            global_unit = rank_units(num_units, dp, src)[step]
            if global_unit < num_units:
                by_unit[global_unit] = _unstack(per_src[src], layers)
        if not padding:
            done[unit] = (float(loss.detach()), report)
    expert_tree = GradTree(expert_params)
    for unit in range(padded_units(num_units, dp)):
        expert_tree.push(by_unit.get(unit))
    dense_grads = finish_over_dp(dense_tree.result(), ps.get_data_parallel_group(), dp)
    by_param = {id(p): g for p, g in zip(dense, dense_grads, strict=True)}
    by_param.update({id(p): g for p, g in zip(expert_params, expert_tree.result(), strict=True)})
    return [by_param[id(p)] for p in params], done


def _unstack(
    stacked: list[torch.Tensor | None], layers: list[torch.nn.Module]
) -> list[torch.Tensor]:
    """Per-layer stacked (w13, w2) gradients -> per-expert gradients in `_expert_params` order
    (an expert no token of the unit reached: zeros)."""
    out: list[torch.Tensor] = []
    pairs = iter(stacked)
    for layer in layers:
        g13, g2 = next(pairs), next(pairs)
        weights = _expert_params(layer)
        n = len(weights) // 2
        for i, p in enumerate(weights):
            g = g13 if i < n else g2
            out.append(torch.zeros_like(p) if g is None else g[i % n])
    return out


__all__ = ["check_expert_parallel_step", "expert_parallel_grads"]
