"""Deliberate faults injected into one site of a live trainer model (negative controls)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from isoexec.contract import ops


class _WideTileAttention:
    """A changed kernel: canonical attention with 32-wide KV tiles instead of 16."""

    isoexec_impls: ClassVar[dict[str, Any]] = {
        "attention": ops.get_impl("attention", kv_tile=32),
        "rope": ops.get_impl("rope"),
    }

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor):
        from isoexec.megatron.canonical_modules import packed_positions

        pos = packed_positions(cu, q.shape[0]).to(q.device)
        cos, sin = ops.rope_cos_sin(pos, self.head_dim, self.rope_theta)  # type: ignore[attr-defined]
        q = ops.apply_rope(q, cos, sin, self.head_dim)  # type: ignore[attr-defined]
        k = ops.apply_rope(k, cos, sin, self.head_dim)  # type: ignore[attr-defined]
        return ops.attention_varlen(q, k, v, cu, scale=self.scale, kv_tile=32)  # type: ignore[attr-defined]


def widen_attention_tile(core: torch.nn.Module) -> None:
    """Make one `IsoCoreAttention` run (and declare) 32-wide KV tiles."""
    core.__class__ = type("WideTileIsoCoreAttention", (_WideTileAttention, type(core)), {})
