"""Expert parallelism (EP>1) for the canonical MoE layer: every expert output bit for bit as
at EP=1, on Megatron's all-gather dispatch pattern over the expert-parallel group.

Megatron's all-gather token dispatcher gathers every rank's tokens, each rank runs its local
experts, and the expert outputs go back by reduce-scatter. Its combine is what breaks
bitwise equality with EP=1: each rank sums its experts' probability-weighted outputs into the
token rows (a scatter-add), and the reduce-scatter then adds the ranks' partial sums, an
addition order that depends on where the experts live.

Here the communication is Megatron's (`gather_from_sequence_parallel_region`,
`reduce_scatter_to_sequence_parallel_region`, over the EP group), and what travels is not a
sum but the per-(token, slot) expert outputs `[T, k, H]`: each slot is computed by the one
rank holding its expert, every other rank contributes -0.0 (the exact additive identity), so
the reduce-scatter reassembles every slot exactly whatever its order. The token's combine
then runs locally, in the canonical fixed order (`ops.moe_combine(..., expert_out=...)`).
A slot's bits come from the row-invariant canonical linear, so computing it among other
ranks' tokens does not change them.

Forward only: the backward of the gather (a reduce-scatter of the token gradients from every
rank's experts) sums real contributions in an EP-dependent order, so `train_step` refuses
EP>1 (`scoring.train_step`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

NO_EXPERT = -1  # the expert id of padding rows: no rank computes them


def exchange_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    local_outputs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """This rank's tokens' expert outputs [T, k, H], each slot computed where its expert lives.

    `local_outputs(x_all, ids_all)` returns [N, k, H] for the gathered tokens: the rank's local
    experts' outputs, -0.0 in every other slot (`ops.moe_experts(..., first_expert=...)`).
    Ranks may hold different numbers of tokens: each pads to the group's maximum (padding
    rows route to `NO_EXPERT`) and drops the padding afterwards.
    """
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    t, k = topk_ids.shape
    rows = torch.tensor([t], dtype=torch.int64)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    pad = int(rows) - t
    x_pad = torch.cat([x, x.new_zeros(pad, x.shape[-1])]) if pad else x
    ids_pad = torch.cat([topk_ids, topk_ids.new_full((pad, k), NO_EXPERT)]) if pad else topk_ids
    x_all = gather_from_sequence_parallel_region(x_pad, group=group)
    with torch.no_grad():
        ids_all = gather_from_sequence_parallel_region(ids_pad, group=group)
    partial = local_outputs(x_all, ids_all)  # [N, k, H]
    h = partial.shape[-1]
    mine = reduce_scatter_to_sequence_parallel_region(
        partial.reshape(partial.shape[0], k * h), group=group
    )
    return mine.reshape(-1, k, h)[:t]


__all__ = ["NO_EXPERT", "exchange_expert_outputs"]
