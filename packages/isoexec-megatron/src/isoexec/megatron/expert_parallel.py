"""Expert parallelism (EP>1) for the canonical MoE layer: every expert output and every
gradient bit for bit as at EP=1, through Megatron's own all-gather token dispatcher.

Megatron's `MoEAllGatherTokenDispatcher` gathers every EP rank's tokens (`token_dispatch`),
each rank runs its local experts, and `token_combine` reduce-scatters the results back. Its
own combine is what breaks bitwise equality with EP=1: each rank sums its experts'
probability-weighted outputs into the token rows and the reduce-scatter adds the ranks'
partial sums, an addition order that depends on where the experts live.

Here the dispatcher's two collectives carry per-(token, slot) tensors instead of sums:
- forward: every slot's input row travels (`slot_inputs`: [T, k, H], slots in ascending
  expert id, the combine's own order); the rank holding a slot's expert computes it, every
  other rank leaves -0.0 (the exact additive identity), so the reduce-scatter reassembles each
  slot exactly whatever its order, and the token's combine runs locally in the canonical order
  (`ops.moe_combine(..., expert_out=...)`);
- backward (autograd through the same collectives): each slot's input gradient is nonzero on
  one rank only, so it returns exactly too, and `slot_inputs` sums a token's k slot gradients
  in a fixed order. The experts' weight gradients are computed per source rank (each block of
  gathered tokens against its own stacked weights, `ExpertBlocks`), so `train_step` gets every
  source unit's expert gradient on its own and sums them in the DP tree, as at EP=1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

NO_EXPERT = -1  # the expert id of padding rows: no rank computes them


class _SlotInputs(torch.autograd.Function):
    """x [T, H] -> [T, k, H] (k copies); backward sums the k slot gradients left to right."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int) -> torch.Tensor:  # type: ignore[override]
        return x.unsqueeze(1).expand(x.shape[0], k, x.shape[1]).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        acc = grad[:, 0]
        for j in range(1, grad.shape[1]):
            acc = acc + grad[:, j]
        return acc, None


def slot_inputs(x: torch.Tensor, k: int) -> torch.Tensor:
    """One input row per (token, slot), [T, k, H]. Under autograd a token's gradient is the sum
    of its slots' gradients in slot order, the same at every EP degree (a broadcast's backward
    would leave the order to the reduction kernel)."""
    return _SlotInputs.apply(x, k)


@dataclass
class ExpertBlocks:
    """The stacked expert weights (w13, w2) each source EP rank's tokens ran against in one
    forward, in source-rank order: `train_step` asks autograd for their gradients, which are
    then the per-source-unit expert gradients (EP=1: one block, this rank's own tokens)."""

    weights: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, weights: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep one block's weights, only under autograd: without a backward to come they
        would hold a copy of the experts until the next forward."""
        if torch.is_grad_enabled():
            self.weights.append(weights)


def dispatched_expert_outputs(
    slots: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: torch.nn.Module,
    dispatcher: object,
    blocks: ExpertBlocks,
) -> torch.Tensor:
    """This rank's tokens' expert outputs [T, k, H], each slot computed where its expert lives.

    `slots` [T, k, H] from `slot_inputs`, `topk_ids` [T, k] ascending per row. `experts`
    (`IsoSequentialMLP`) computes its local experts' slots (`block_outputs`), -0.0 elsewhere.
    Ranks may hold different numbers of tokens: each pads to the group's maximum (padding rows
    route to no expert) and drops the padding afterwards, as Megatron's dispatcher needs equal
    slices.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    if not isinstance(dispatcher, MoEAllGatherTokenDispatcher):
        raise NotImplementedError(
            f"expert parallelism through {type(dispatcher).__name__}: only Megatron's all-gather "
            "dispatcher carries per-slot rows (moe_token_dispatcher_type='allgather')"
        )
    group = dispatcher.tp_ep_group
    t, k, h = slots.shape
    num_experts = dispatcher.config.num_moe_experts
    dev = slots.device  # the collectives' tensors live where the model does (NCCL: CUDA)
    rows = torch.tensor([t], dtype=torch.int64, device=dev)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    pad = int(rows) - t
    if pad:
        slots = torch.cat([slots, slots.new_zeros(pad, k, h)])
    routing_map = torch.zeros(t + pad, num_experts, dtype=torch.bool, device=dev)
    routing_map[:t].scatter_(1, topk_ids, True)
    probs = torch.zeros(t + pad, num_experts, device=dev)  # gathered by the dispatcher, unused
    n = t + pad
    hidden, probs = dispatcher.dispatch_preprocess(slots.reshape(n, k * h), routing_map, probs)
    hidden, _ = dispatcher.token_dispatch(hidden, probs)
    routed = dispatcher.routing_map  # [N, E], gathered in rank order
    ids_all = torch.full((routed.shape[0], k), NO_EXPERT, dtype=topk_ids.dtype, device=dev)
    has = routed.any(dim=1)
    ids_all[has] = routed[has].nonzero()[:, 1].view(-1, k).to(topk_ids.dtype)  # ascending
    outs = []
    for src in range(group.size()):
        block = slice(src * n, (src + 1) * n)
        y, weights = experts.block_outputs(hidden[block].view(n, k, h), ids_all[block])
        blocks.add(weights)
        outs.append(y.reshape(n, k * h))
    # token_combine reduce-scatters in the dtype of `local_probs` (set by dispatch_postprocess,
    # which permutes for Megatron's experts and is not run here): the outputs' own dtype.
    dispatcher.local_probs = slots.new_empty(0)
    mine = dispatcher.token_combine(torch.cat(outs))
    return dispatcher.combine_postprocess(mine).view(n, k, h)[:t]


__all__ = ["NO_EXPERT", "ExpertBlocks", "dispatched_expert_outputs", "slot_inputs"]
