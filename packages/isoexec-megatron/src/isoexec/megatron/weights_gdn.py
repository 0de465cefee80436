"""GDN layers' checkpoint ⇄ Megatron mappings (`weights` has the full picture): the canonical
layer's fused projections, by identity (Qwen3-Next's interleaved tensors) or row-concatenated
(Qwen3.5's split in_proj_qkv/z and in_proj_b/a), and the native `GatedDeltaNet`'s one
`in_proj` ([q | k | v | z | b | a], head-major)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from isoexec.megatron.hf_checkpoint import CheckpointMismatchError
from isoexec.megatron.hf_config import ModelArch
from isoexec.megatron.weight_mapping import ParamMapping, identity_in, identity_out


def _rows_fns(
    sizes: list[int],
) -> tuple[
    Callable[[list[torch.Tensor]], torch.Tensor], Callable[[torch.Tensor], list[torch.Tensor]]
]:
    """Row concatenation of HF tensors with `sizes` rows each, and its inverse."""

    def to_megatron(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(ts, dim=0)

    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        if t.shape[0] != sum(sizes):
            raise CheckpointMismatchError(f"{tuple(t.shape)} does not split into rows {sizes}")
        return list(t.split(sizes, dim=0))

    return to_megatron, to_hf


def gdn_projection_mappings(arch: ModelArch, sa: str, la: str) -> list[ParamMapping]:
    """The GDN input projections: fused checkpoint tensors by identity (Qwen3-Next), or the
    split ones row-concatenated (Qwen3.5, "flat")."""
    gdn = arch.gdn
    assert gdn is not None
    if gdn.layout == "interleaved":
        return [
            ParamMapping(f"{sa}.{p}", (f"{la}.{p}",), identity_in, identity_out)
            for p in ("in_proj_qkvz.weight", "in_proj_ba.weight")
        ]
    key_dim = gdn.num_key_heads * gdn.key_head_dim
    value_dim = gdn.num_value_heads * gdn.value_head_dim
    qkvz_in, qkvz_out = _rows_fns([2 * key_dim + value_dim, value_dim])
    ba_in, ba_out = _rows_fns([gdn.num_value_heads, gdn.num_value_heads])
    return [
        ParamMapping(
            f"{sa}.in_proj_qkvz.weight",
            (f"{la}.in_proj_qkv.weight", f"{la}.in_proj_z.weight"),
            qkvz_in,
            qkvz_out,
        ),
        ParamMapping(
            f"{sa}.in_proj_ba.weight",
            (f"{la}.in_proj_b.weight", f"{la}.in_proj_a.weight"),
            ba_in,
            ba_out,
        ),
    ]


def _native_gdn_in_proj_fns(
    arch: ModelArch,
) -> tuple[
    Callable[[list[torch.Tensor]], torch.Tensor], Callable[[torch.Tensor], list[torch.Tensor]]
]:
    """Megatron `GatedDeltaNet.in_proj` [q | k | v | z | b | a] ⇄ HF's GDN projections."""
    gdn = arch.gdn
    assert gdn is not None
    hk, hv, kd, vd = gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim
    if gdn.layout == "flat":  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: rows as they are
        return _rows_fns([2 * hk * kd + hv * vd, hv * vd, hv, hv])
    r = hv // hk
    blocks = [hk * kd, hk * kd, hv * vd, hv * vd, hv, hv]  # q, k, v, z, b, a
    qkvz_split, ba_split = [kd, kd, r * vd, r * vd], [r, r]  # per key-head group

    def to_megatron(ts: list[torch.Tensor]) -> torch.Tensor:
        qkvz, ba = ts
        h = qkvz.shape[-1]
        per_group = [*qkvz.reshape(hk, sum(qkvz_split), h).split(qkvz_split, dim=1)]
        per_group += [*ba.reshape(hk, sum(ba_split), h).split(ba_split, dim=1)]
        return torch.cat([t.reshape(-1, h) for t in per_group], dim=0)

    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        if t.shape[0] != sum(blocks):
            raise CheckpointMismatchError(f"{tuple(t.shape)} does not split into rows {blocks}")
        h = t.shape[-1]
        q, k, v, z, b, a = (x.reshape(hk, -1, h) for x in t.split(blocks, dim=0))
        return [torch.cat([q, k, v, z], dim=1).reshape(-1, h), torch.cat([b, a], 1).reshape(-1, h)]

    return to_megatron, to_hf


def native_gdn_mappings(arch: ModelArch, sa: str, la: str) -> list[ParamMapping]:
    """The parameters of Megatron's `GatedDeltaNet` in the `self_attention` slot."""
    assert arch.gdn is not None
    if arch.gdn.layout == "flat":
        hf_proj = tuple(f"{la}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
    else:
        hf_proj = (f"{la}.in_proj_qkvz.weight", f"{la}.in_proj_ba.weight")
    to_megatron, to_hf = _native_gdn_in_proj_fns(arch)
    maps = [ParamMapping(f"{sa}.in_proj.weight", hf_proj, to_megatron, to_hf)]
    for meg, hf in (
        ("conv1d.weight", "conv1d.weight"),
        ("dt_bias", "dt_bias"),
        ("A_log", "A_log"),
        ("out_norm.weight", "norm.weight"),
        ("out_proj.weight", "out_proj.weight"),
    ):
        maps.append(ParamMapping(f"{sa}.{meg}", (f"{la}.{hf}",), identity_in, identity_out))
    return maps
