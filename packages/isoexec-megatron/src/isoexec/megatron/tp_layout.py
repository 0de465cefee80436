"""Tensor-parallel layout of Megatron parameters: full (TP=1) tensor ⇄ this rank's shard.

HF weights map onto the *full* Megatron layout (`weights.param_mappings`); at TP>1 each rank
keeps its slice, and export gathers the slices back. Both directions are pure copies, so the
HF round trip stays bit-exact at any TP. Megatron marks sharded parameters itself
(`tensor_model_parallel`, `partition_dim`), and its layouts are chosen so that a contiguous
slice is a rank's shard — QKV rows are grouped per query group, the vocab is split in
contiguous ranges — with one exception: a gated fc1 holds `[gate_r; up_r]` per rank, not a
contiguous slice of `[gate; up]`.

Experts are whole on every rank (`megatron_parallel()` sets expert TP = 1), so their
parameters are replicated here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: `size` ranks along `dim`; `glu`: halves split separately."""

    size: int
    rank: int
    dim: int
    glu: bool
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
    return ShardSpec(
        size=size,
        rank=ps.get_tensor_model_parallel_rank(),
        dim=int(param.partition_dim),  # type: ignore[attr-defined]
        glu=name.endswith("linear_fc1.weight"),
        group=ps.get_tensor_model_parallel_group(),
    )


def local_shard(full: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's slice of a full-layout tensor."""
    if spec is None:
        return full
    if full.shape[spec.dim] % (spec.size * (2 if spec.glu else 1)):
        raise ValueError(f"dim {spec.dim} of {tuple(full.shape)} does not split {spec.size} ways")
    if spec.glu:
        gate, up = full.chunk(2, dim=spec.dim)
        return torch.cat(
            [
                gate.chunk(spec.size, dim=spec.dim)[spec.rank],
                up.chunk(spec.size, dim=spec.dim)[spec.rank],
            ],
            dim=spec.dim,
        )
    return full.chunk(spec.size, dim=spec.dim)[spec.rank]


def gather_full(local: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The full-layout tensor from every rank's slice (a collective: all ranks must call it)."""
    if spec is None:
        return local
    parts = [torch.empty_like(local) for _ in range(spec.size)]
    dist.all_gather(parts, local.contiguous(), group=spec.group)  # type: ignore[arg-type]
    if spec.glu:
        halves = [p.chunk(2, dim=spec.dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=spec.dim)
    return torch.cat(parts, dim=spec.dim)


__all__ = ["ShardSpec", "gather_full", "local_shard", "shard_spec"]
