"""Deliberate faults injected into one site of a live trainer model (negative controls)."""

from __future__ import annotations

import torch

from isoexec.contract import ops

FAULT_KV_TILE = 32  # the canonical attention's default is ops.attention.DEFAULT_KV_TILE


class _WideTileAttention:
    """A changed kernel: canonical attention with another KV tile than the default."""

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor):
        from isoexec.megatron.canonical_modules import packed_positions

        pos = packed_positions(cu, q.shape[0]).to(q.device)
        cos, sin = ops.rope_cos_sin(pos, self.head_dim, self.rope_theta)  # type: ignore[attr-defined]
        q = ops.apply_rope(q, cos, sin, self.head_dim)  # type: ignore[attr-defined]
        k = ops.apply_rope(k, cos, sin, self.head_dim)  # type: ignore[attr-defined]
        return ops.attention_varlen(q, k, v, cu, scale=self.scale, kv_tile=FAULT_KV_TILE)  # type: ignore[attr-defined]


def widen_attention_tile(core: torch.nn.Module) -> None:
    """Make one `IsoCoreAttention` run (and declare, on the instance, where the contract
    read-back looks) `FAULT_KV_TILE`-wide KV tiles."""
    assert FAULT_KV_TILE != ops.attention.DEFAULT_KV_TILE
    core.__class__ = type("WideTileIsoCoreAttention", (_WideTileAttention, type(core)), {})
    core.isoexec_impls = {
        "attention": ops.get_impl("attention", kv_tile=FAULT_KV_TILE),
        "rope": ops.get_impl("rope"),
    }
