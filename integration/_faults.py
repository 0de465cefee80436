"""Deliberate faults injected into one site of a live trainer model (negative controls)."""

from __future__ import annotations

import torch

from isoexec import ops

FAULT_LANES = 8  # the canonical attention's default is ops.attention.DEFAULT_LANES


class _NarrowLaneAttention:
    """A changed kernel: canonical attention with another lane count than the default."""

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor):
        from isoexec.megatron.canonical_modules import packed_positions

        pos = packed_positions(cu, q.shape[0]).to(q.device)
        cos, sin = ops.rope_cos_sin(pos, self.head_dim, self.rope_theta)  # type: ignore[attr-defined]
        q = ops.apply_rope(q, cos, sin, self.head_dim)  # type: ignore[attr-defined]
        k = ops.apply_rope(k, cos, sin, self.head_dim)  # type: ignore[attr-defined]
        return ops.attention_varlen(q, k, v, cu, scale=self.scale, lanes=FAULT_LANES)  # type: ignore[attr-defined]


def narrow_attention_lanes(core: torch.nn.Module) -> None:
    """Make one `IsoCoreAttention` run (and declare, on the instance, where the contract
    read-back looks) `FAULT_LANES` accumulator lanes."""
    assert FAULT_LANES != ops.attention.DEFAULT_LANES
    core.__class__ = type("NarrowLaneIsoCoreAttention", (_NarrowLaneAttention, type(core)), {})
    core.isoexec_impls = {
        "attention": ops.get_impl("attention", lanes=FAULT_LANES),
        "rope": ops.get_impl("rope"),
    }
