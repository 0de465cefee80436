"""The canonical core attention for Megatron (RoPE + varlen attention per packed sequence):
the trainer's side of `isoexec.vllm.attention`, with RoPE as its own site module,
`IsoRotaryEmbedding`, as vLLM's attention holds its `rotary_emb`."""

from __future__ import annotations

from typing import Any

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.megatron.canonical_base import (
    CanonicalSiteError,
    bind,
    site_binding,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


# ---- attention -------------------------------------------------------------------------------
def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed row inside its own sequence (0 at each cu_seqlens start)."""
    cu = cu_seqlens.to(torch.int64).cpu()
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lens < 0).any()):
        raise CanonicalSiteError(f"cu_seqlens {cu.tolist()} do not cover {total} packed rows")
    starts = torch.repeat_interleave(cu[:-1], lens)
    return torch.arange(total) - starts


class IsoRotaryEmbedding(torch.nn.Module):
    """The RoPE site (`layers.N.self_attn.rope`): canonical neox-style rope of q and k at
    their positions, fp32 cos/sin of `theta`, the first `rotary_dim` dims of each head
    rotated. The trainer's twin of vLLM's `rotary_emb` (`isoexec.vllm.layers
    .IsoRotaryEmbedding`): a module of its own, so it is bound, read back, traced and verified
    like every other site. It has no parameters (nothing to load or export)."""

    isoexec_impl: ImplInfo

    def __init__(self, config: TransformerConfig, head_dim: int, rotary_dim: int, theta: float):
        super().__init__()
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise CanonicalSiteError(f"rotary dim {rotary_dim} for head dim {head_dim}")
        self.head_dim, self.rotary_dim, self.theta = head_dim, rotary_dim, float(theta)
        bind(self, site_binding(config, "rope"))

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] rotated at `positions` [T]."""
        cos, sin = self.ops.rope_cos_sin(positions, self.rotary_dim, self.theta)
        q = self.ops.apply_rope(query, cos, sin, self.rotary_dim)
        k = self.ops.apply_rope(key, cos, sin, self.rotary_dim)
        return q, k


class IsoCoreAttention(MegatronModule):
    """Core attention slot: canonical RoPE (`rotary`, its own site) then
    `ops.attention_varlen` (causal, GQA).

    Reads packed sequences (`PackedSeqParams`, qkv_format 'thd': q/k/v [T, H, D]) or Megatron's
    [s, b, H, D] (each batch row one sequence from position 0). RoPE is applied here because
    the isoexec model has no Megatron rotary embedding: Megatron's `apply_rotary_pos_emb`
    (freqs table + its own rounding) is not the canonical rope.
    """

    isoexec_impl: ImplInfo

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        problems = []
        if attn_mask_type != AttnMaskType.causal:
            problems.append(f"mask type {attn_mask_type}")
        if attention_type != "self":
            problems.append(f"attention type {attention_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            problems.append(f"attention dropout {dropout}")
        if config.context_parallel_size != 1:
            problems.append("context parallelism")
        if config.rotary_interleaved:
            problems.append("interleaved RoPE")
        theta = getattr(config, "isoexec_rope_theta", None)
        if theta is None:
            problems.append("no RoPE base (build the config as IsoTransformerConfig)")
        if problems:
            raise CanonicalSiteError("canonical attention does not support: " + ", ".join(problems))
        # Any TP: heads are independent, and q/k/v arrive with this rank's heads only.
        bind(self, site_binding(config, "attention"))
        self.head_dim = int(config.kv_channels)
        rotary_dim = getattr(config, "isoexec_rotary_dim", None)
        self.rotary = IsoRotaryEmbedding(
            config,
            self.head_dim,
            self.head_dim if rotary_dim is None else int(rotary_dim),
            float(theta),  # type: ignore[arg-type]
        )
        # vLLM's Qwen3 attention: `self.scaling = self.head_dim**-0.5`, the same float.
        self.scale = float(softmax_scale) if softmax_scale is not None else self.head_dim**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise CanonicalSiteError(
                "canonical attention is causal from sequence boundaries: pass attention_mask="
                "None and express padding/packing with PackedSeqParams"
            )
        if attention_bias is not None:
            raise CanonicalSiteError("attention bias is not canonical")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise CanonicalSiteError(f"mask type {attn_mask_type} is not canonical")
        if packed_seq_params is not None:
            p = packed_seq_params
            if p.qkv_format != "thd":
                raise CanonicalSiteError(f"packed qkv_format {p.qkv_format!r} (only 'thd')")
            cu = p.cu_seqlens_q
            for other in (p.cu_seqlens_kv, p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded):
                if other is not None and not torch.equal(other.cpu(), cu.cpu()):
                    raise CanonicalSiteError("cu_seqlens for q, kv and padded forms must agree")
            out = self._attend(query, key, value, cu)
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[:2]
        flat = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value)]
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
        out = self._attend(*flat, cu)  # [b*s, H, D]
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]: rope (its own site, `rotary`), then attention."""
        q, k = self.rotary(packed_positions(cu, q.shape[0]).to(q.device), q, k)
        return self.ops.attention_varlen(q, k, v, cu.to(q.device), scale=self.scale)
