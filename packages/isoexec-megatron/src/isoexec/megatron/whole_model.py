"""The whole model's exported weights when it is split over ranks: every weight handed out by
exactly one rank.

Why: at PP>1 a rank exports its own stage's weights, at EP>1 its own experts (and the
replicated rest), so no single rank's `export_hf_weights` is the model. Every rank lists the
HF names it exports (no tensor copied), the lists are all-gathered, and each name is owned by
the lowest rank that exports it. A weight sync publishes each rank's owned weights, so the
parts together are the model, each weight once; the whole model's fingerprint merges the
ranks' per-tensor digests into the digest one process holding everything would compute. (TP
ranks export whole tensors, the export gathering their shards: the lowest TP rank owns them.)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from isoexec.contract.fingerprint import WeightFingerprint, tensor_digest
from isoexec.megatron.weights import export_hf_weights, hf_weight_names


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def export_owners(model: torch.nn.Module) -> dict[str, int]:
    """HF name -> the rank that hands it out (every rank must call: an all-gather)."""
    import torch.distributed as dist

    rank, world = _world()
    names = hf_weight_names(model)
    if world == 1:
        return dict.fromkeys(names, rank)
    every: list[list[str] | None] = [None] * world
    dist.all_gather_object(every, names)
    owners: dict[str, int] = {}
    for r, held in enumerate(every):
        for name in held or []:
            owners.setdefault(name, r)
    return owners


def owned_exports(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's share of the whole model's export, in export order. Every rank must run it
    to the end: the export gathers TP shards, a collective."""
    rank, _ = _world()
    owners = export_owners(model)
    for name, tensor in export_hf_weights(model):
        if owners[name] == rank:
            yield name, tensor


def whole_model_fingerprint(model: torch.nn.Module) -> WeightFingerprint:
    """The fingerprint of the whole model's export, the same on every rank (every rank must
    call): each rank digests what it owns and the digests are all-gathered."""
    import torch.distributed as dist

    mine = {name: tensor_digest(name, t) for name, t in owned_exports(model)}
    _, world = _world()
    if world == 1:
        return WeightFingerprint.from_digests(mine)
    every: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(every, mine)
    merged: dict[str, str] = {}
    for part in every:
        merged.update(part or {})
    return WeightFingerprint.from_digests(merged)


__all__ = ["export_owners", "owned_exports", "whole_model_fingerprint"]
