"""Deliberate faults injected into one site of a live trainer model (negative controls)."""

from __future__ import annotations

import torch

from isoexec import ops

FAULT_LANES = 8  # the canonical attention's default is ops.attention.DEFAULT_LANES


class _NarrowLaneAttention:
    """A changed kernel: canonical attention with another lane count than the default, called
    past the site's binding (`isoexec.ops` directly)."""

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor):
        from isoexec.megatron.canonical_modules import packed_positions

        q, k = self.rotary(packed_positions(cu, q.shape[0]).to(q.device), q, k)  # type: ignore[attr-defined]
        return ops.attention_varlen(q, k, v, cu, scale=self.scale, lanes=FAULT_LANES)  # type: ignore[attr-defined]


def narrow_attention_lanes(core: torch.nn.Module) -> None:
    """Make one `IsoCoreAttention` run (and declare, on the instance, where the contract
    read-back looks) `FAULT_LANES` accumulator lanes."""
    assert FAULT_LANES != ops.attention.DEFAULT_LANES
    core.__class__ = type("NarrowLaneIsoCoreAttention", (_NarrowLaneAttention, type(core)), {})
    core.isoexec_impl = ops.get_impl("attention", lanes=FAULT_LANES)
