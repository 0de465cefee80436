"""Tensor-parallel layout of Megatron parameters: full (TP=1) tensor ⇄ this rank's shard.

HF weights map onto the *full* Megatron layout (`weights.param_mappings`); at TP>1 each rank
keeps its slice, and export gathers the slices back. Both directions are pure copies, so the
HF round trip stays bit-exact at any TP. Megatron marks sharded parameters itself
(`tensor_model_parallel`, `partition_dim`), and its layouts are chosen so that a contiguous
slice is a rank's shard — QKV rows are grouped per query group, the vocab is split in
contiguous ranges — with exceptions where the full tensor is several blocks side by side and a
rank holds its slice of *each* block:
- a gated fc1 holds `[gate_r; up_r]` per rank, not a contiguous slice of `[gate; up]`;
- a parameter that declares `isoexec_tp_blocks` (full block sizes along its partition dim):
  the canonical GDN layer's conv channels [q | k | v] and, in the flat (Qwen3.5) layout, its
  projections [q | k | v | z] and [b | a] (`gdn`).

Experts are whole on every rank (`megatron_parallel()` sets expert TP = 1), so their
parameters are replicated here; so is a shared expert (`IsoSharedExpertMLP` clears its
`tensor_model_parallel` marks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: `size` ranks along `dim`. `blocks`: the full sizes of the
    consecutive blocks along `dim`, each split `size` ways separately (empty: one block)."""

    size: int
    rank: int
    dim: int
    blocks: tuple[int, ...] = ()
    group: object = None


def shard_spec(name: str, param: torch.nn.Parameter) -> ShardSpec | None:
    """The split of Megatron parameter `name`, or None when every rank holds it whole."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return None
    if ".mlp.experts." in name:
        etp = ps.get_expert_tensor_parallel_world_size()
        if etp != 1:
            raise NotImplementedError(f"{name}: expert tensor parallelism {etp} is not supported")
        return None
    size = ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return None
    dim = int(param.partition_dim)  # type: ignore[attr-defined]
    blocks: tuple[int, ...] = tuple(getattr(param, "isoexec_tp_blocks", ()))
    if not blocks and name.endswith("linear_fc1.weight"):  # [gate; up]
        half = param.shape[dim] * size // 2
        blocks = (half, half)
    if blocks and sum(blocks) != param.shape[dim] * size:
        raise ValueError(f"{name}: blocks {blocks} do not add up to {param.shape[dim]} x {size}")
    return ShardSpec(
        size=size,
        rank=ps.get_tensor_model_parallel_rank(),
        dim=dim,
        blocks=blocks,
        group=ps.get_tensor_model_parallel_group(),
    )


def local_shard(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's slice of a full-layout tensor."""
    if spec is None:
        return full
    blocks = spec.blocks or (full.shape[spec.dim],)
    if sum(blocks) != full.shape[spec.dim] or any(b % spec.size for b in blocks):
        raise ValueError(
            f"dim {spec.dim} of {tuple(full.shape)} (blocks {blocks}) does not split "
            f"{spec.size} ways"
        )
    parts = [
        b.chunk(spec.size, dim=spec.dim)[spec.rank] for b in full.split(list(blocks), spec.dim)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def gather_full(local: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The full-layout tensor from every rank's slice (a collective: all ranks must call it)."""
    if spec is None:
        return local
    parts = [torch.empty_like(local) for _ in range(spec.size)]
    dist.all_gather(parts, local.contiguous(), group=spec.group)  # type: ignore[arg-type]
    if not spec.blocks:
        return torch.cat(parts, dim=spec.dim)
    local_sizes = [b // spec.size for b in spec.blocks]
    per_rank = [p.split(local_sizes, dim=spec.dim) for p in parts]
    return torch.cat(
        [r[i] for i in range(len(local_sizes)) for r in per_rank],
        dim=spec.dim,
    )


__all__ = ["ShardSpec", "gather_full", "local_shard", "shard_spec"]
