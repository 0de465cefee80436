"""Qwen3-Next and Qwen3.5 text on the trainer: a canonical Gated DeltaNet layer, its gated
output norm and the gated full attention, for Megatron's ModuleSpec slots.

Megatron-core's own `GatedDeltaNet` is the native arm (`build_model(isoexec=False)`), but it
cannot be the canonical layer: it only runs the chunked delta rule (never bitwise equal to the
engine's recurrent form), refuses packed sequences, and its fused `in_proj` layout is not HF's.
So the isoexec linear-attention layer's `self_attention` slot holds
`IsoGatedDeltaNet`, which computes exactly what the engine's `IsoQwenGatedDeltaNetAttention`
(`isoexec.vllm.gdn`) computes for a request that starts from empty state:

    in_proj_qkvz, in_proj_ba (canonical linears on HF's fused, per key-head-group layouts
    [q | k | v×r | z×r] and [b | a]) -> split heads -> per packed sequence: `ops.gdn_conv`
    (zero conv state) -> `ops.gdn_recurrence` (token-serial, zero fp32 state) ->
    `ops.gated_rms_norm` -> out_proj (canonical linear)

Per sequence because the GDN state of every sequence of a pack starts from zero at its
boundary. Qwen3.5 stores the projections split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`); the layer then holds them row-concatenated, `[qkv; z]` and `[b; a]` ("flat"
layout), exactly the fused weights vLLM's non-interleaved GDN layer GEMMs.

The full-attention layers use Megatron's `SelfAttention` with
`attention_output_gate` (linear_qkv per group [q | gate | k | v]); `IsoGatedSelfAttention`
only replaces the gate's `x * sigmoid(gate.float())` by the engine's model-dtype
`out * sigmoid(gate)` with the position-invariant sigmoid.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from isoexec import ops
from isoexec.contract.impl import ImplInfo
from isoexec.megatron.canonical_modules import (
    CanonicalSiteError,
    bind,
    site_binding,
)
from isoexec.megatron.hf_config import GDN_LAYOUTS
from isoexec.ops.binding import SiteBinding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

# The gate is shared with the other side: isoexec.ops.attn_output_gate.
attn_output_gate = ops.attn_output_gate
ATTN_OUTPUT_GATE_IMPL = ops.ATTN_OUTPUT_GATE_IMPL


def packed_bounds(
    hidden_states: torch.Tensor, packed_seq_params: Any
) -> tuple[torch.Tensor, list[int]]:
    """(rows [T, H], sequence starts [0, .., T]) of Megatron's [s, b, H] input.

    Packed ('thd', b = 1): the cu_seqlens; otherwise every batch row is one sequence.
    """
    s, b, h = hidden_states.shape
    if packed_seq_params is None:
        return hidden_states.transpose(0, 1).reshape(b * s, h), list(range(0, (b + 1) * s, s))
    p = packed_seq_params
    if p.qkv_format != "thd" or b != 1:
        raise CanonicalSiteError(f"packed qkv_format {p.qkv_format!r} with batch {b} (only thd)")
    cu = p.cu_seqlens_q.cpu()
    for other in (p.cu_seqlens_kv, p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded):
        if other is not None and not torch.equal(other.cpu(), cu):
            raise CanonicalSiteError("cu_seqlens for q, kv and padded forms must agree")
    starts = [int(c) for c in cu.tolist()]
    if starts[0] != 0 or starts[-1] != s or any(e < a for a, e in itertools.pairwise(starts)):
        raise CanonicalSiteError(f"cu_seqlens {starts} do not cover {s} packed rows")
    return hidden_states.reshape(s, h), starts


class IsoGatedRMSNorm(torch.nn.Module):
    """GDN output norm slot: `ops.gated_rms_norm(x, z, w)` = norm(x)·w·silu(z), fp32, one
    rounding (vLLM's `RMSNormGated` under IsoExec). Plain gamma (not zero-centred).

    The weight [V] is shared by every value head. At TP>1 it is replicated while each rank
    normalises only its own heads, so each rank's weight gradient is partial: the weight enters
    the TP region (`copy_to_tensor_model_parallel_region`: identity forward, gradient summed
    over `tp_group`), so the gradient is whole on every rank whatever optimizer runs next.
    """

    isoexec_impl: ImplInfo

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.tp_group = tp_group
        bind(self, site_binding(config, "gated_rms_norm"))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            w = copy_to_tensor_model_parallel_region(w, group=self.tp_group)
        return self.ops.gated_rms_norm(x, z, w, self.eps)


@dataclass
class GDNSubmodules:
    """The classes in the GDN layer's slots (Megatron-style, so a spec can swap them)."""

    in_proj_qkvz: type
    in_proj_ba: type
    norm: type
    out_proj: type


class IsoGatedDeltaNet(MegatronModule):
    """Linear-attention (`self_attention`) slot of a GDN-hybrid layer, canonical.

    Parameters, named and laid out as HF's `linear_attn.*` so weights load by identity (or,
    for the flat layout, by row concatenation):
    `in_proj_qkvz.weight` [2·HK·K + 2·HV·V, H] (interleaved: per key-head group
    [q | k | v×r | z×r]; flat: [q | k | v | z]), `in_proj_ba.weight` [2·HV, H] (interleaved:
    per group [b×r | a×r]; flat: [b | a]), `conv1d_weight` [C, 1, W] (channels
    [q | k | v], HF's `conv1d.weight`), `dt_bias` [HV], `A_log` [HV], `norm.weight` [V],
    `out_proj.weight` [H, HV·V]. Sizes come from TransformerConfig's `linear_*` fields.

    `A_log` is fp32 whatever the model dtype, as vLLM holds it (`QwenGatedDeltaNetAttention`
    creates it fp32): a bf16 model loaded from an fp32 checkpoint must not round it, or the
    decay differs from the engine's. It is marked `isoexec_keep_fp32`.

    Tensor parallelism: a rank holds the contiguous key-head groups `[rank·HK/tp, ..)` and
    their value heads `[rank·HV/tp, ..)`. Heads never mix before out_proj (the conv is
    depthwise, the recurrence runs per value head with its key head, the gated norm per head,
    and `ops.linear` gives each output column from its own weight row), so the rank's heads
    carry the TP=1 bits; out_proj is row-parallel over those value heads and must be the
    `linear_tp` leaves (`isoexec_tp_leaves`). Local layouts are the full ones restricted to the
    rank's heads: interleaved projections are per group, so a contiguous row slice; the flat
    ones ([q | k | v | z], [b | a]) and the conv channels ([q | k | v]) are block layouts, a
    slice of every block, which the parameters declare as `isoexec_tp_blocks` (full block
    sizes) for `tp_layout`. `dt_bias`, `A_log` (per value head) are contiguous slices; the
    norm weight (per head dim) is replicated.
    """

    isoexec_impls: dict[str, ImplInfo]

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GDNSubmodules,
        layer_number: int | None = None,
        pg_collection: Any = None,
        cp_comm_type: str | None = None,
        qkvz_layout: str = "interleaved",
    ) -> None:
        super().__init__(config=config)
        bind(self, site_binding(config, "gdn_conv"), site_binding(config, "gdn_recurrence"))
        problems = []
        if qkvz_layout not in GDN_LAYOUTS:
            problems.append(f"projection layout {qkvz_layout!r}")
        if config.activation_func is not torch.nn.functional.silu:
            problems.append("conv activation other than silu")
        if config.context_parallel_size != 1:
            problems.append("context parallelism")
        if config.sequence_parallel:
            problems.append("sequence parallelism")
        if config.add_bias_linear:
            problems.append("linear biases")
        if problems:
            raise CanonicalSiteError("canonical GDN does not support: " + ", ".join(problems))
        self.layer_number = layer_number
        self.qkvz_layout = qkvz_layout
        tp_group = getattr(pg_collection, "tp", None)
        if tp_group is None:
            from megatron.core import parallel_state as ps

            tp_group = ps.get_tensor_model_parallel_group()
        tp = int(tp_group.size())
        hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.kd, self.vd = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        self.kernel = int(config.linear_conv_kernel_dim)
        if hv % hk:
            raise CanonicalSiteError(f"{hv} value heads not a multiple of {hk} key heads")
        if hk % tp:
            raise CanonicalSiteError(
                f"TP={tp} does not divide the {hk} GDN key heads (a rank holds whole key-head "
                "groups with their value heads)"
            )
        if tp > 1 and getattr(config, "isoexec_tp_leaves", None) is None:
            raise CanonicalSiteError(
                f"GDN at TP={tp}: out_proj is row-parallel; build with tp_invariant=True"
            )
        # Heads of this rank (all of them at TP=1); the full sizes for the linears' builders.
        self.hk, self.hv = hk // tp, hv // tp
        key_dim, value_dim = hk * self.kd, hv * self.vd
        self.conv_dim = (2 * key_dim + value_dim) // tp
        linear_kw: dict[str, Any] = dict(
            config=config, bias=False, is_expert=False, tp_group=tp_group
        )
        self.in_proj_qkvz = build_module(
            submodules.in_proj_qkvz,
            config.hidden_size,
            2 * key_dim + 2 * value_dim,
            init_method=config.init_method,
            gather_output=False,
            skip_bias_add=False,
            tp_comm_buffer_name="fc1",
            **linear_kw,
        )
        self.in_proj_ba = build_module(
            submodules.in_proj_ba,
            config.hidden_size,
            2 * hv,
            init_method=config.init_method,
            gather_output=False,
            skip_bias_add=False,
            tp_comm_buffer_name="fc1",
            **linear_kw,
        )
        dtype = config.params_dtype
        self.conv1d_weight = torch.nn.Parameter(
            torch.empty(self.conv_dim, 1, self.kernel, dtype=dtype)
        )
        self.dt_bias = torch.nn.Parameter(torch.ones(self.hv, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.hv, dtype=torch.float32))
        self.A_log.isoexec_keep_fp32 = True  # type: ignore[attr-defined]
        for p in (self.conv1d_weight, self.dt_bias, self.A_log):
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
        # Block layouts (full sizes): each rank holds its heads' slice of every block.
        blocks = [(self.conv1d_weight, (key_dim, key_dim, value_dim))]
        if qkvz_layout == "flat":
            blocks.append((self.in_proj_qkvz.weight, (key_dim, key_dim, value_dim, value_dim)))
            blocks.append((self.in_proj_ba.weight, (hv, hv)))
        for p, sizes in blocks:
            p.isoexec_tp_blocks = sizes  # type: ignore[attr-defined]
        if config.perform_initialization:  # HF's init; real runs load weights over it
            with torch.no_grad():
                bound = self.kernel**-0.5
                self.conv1d_weight.uniform_(-bound, bound)
                self.A_log.copy_(torch.empty(self.hv).uniform_(1, 16).log())
        else:
            torch.nn.init.zeros_(self.conv1d_weight)
            torch.nn.init.zeros_(self.A_log)
        self.norm = build_module(
            submodules.norm,
            config=config,
            hidden_size=self.vd,
            eps=config.layernorm_epsilon,
            tp_group=tp_group,
        )
        self.out_proj = build_module(
            submodules.out_proj,
            value_dim,
            config.hidden_size,
            init_method=config.output_layer_init_method,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_comm_buffer_name="fc2",
            **linear_kw,
        )

    def split_projections(
        self, mixed_qkvz: torch.Tensor, ba: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv input [T, C] = [q | k | v], z [T, HV, V], b [T, HV], a [T, HV]).

        Pure data movement: vLLM's `fix_query_key_value_ordering` + concatenation
        (interleaved), or its plain splits (flat).
        """
        t, r = mixed_qkvz.shape[0], self.hv // self.hk
        if self.qkvz_layout == "flat":
            mixed_qkv, z = mixed_qkvz.split([self.conv_dim, self.hv * self.vd], dim=-1)
            b, a = ba.chunk(2, dim=-1)
            return mixed_qkv, z.reshape(t, self.hv, self.vd), b, a
        qkvz = mixed_qkvz.view(t, self.hk, 2 * self.kd + 2 * r * self.vd)
        q, k, v, z = torch.split(qkvz, [self.kd, self.kd, r * self.vd, r * self.vd], dim=2)
        b, a = torch.split(ba.view(t, self.hk, 2 * r), [r, r], dim=2)
        mixed_qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (
            mixed_qkv,
            z.reshape(t, self.hv, self.vd),
            b.reshape(t, self.hv),
            a.reshape(t, self.hv),
        )

    def core(
        self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, starts: list[int]
    ) -> torch.Tensor:
        """Conv + recurrence per sequence, each from zero state: [T, HV, V] in x's dtype."""
        conv_w = self.conv1d_weight.view(self.conv_dim, self.kernel)
        hk, hv, kd, vd = self.hk, self.hv, self.kd, self.vd
        outs = []
        for s, e in itertools.pairwise(starts):
            if e == s:
                continue
            o, _, _ = ops.gdn_sequence(
                mixed_qkv[s:e], conv_w, a[s:e], b[s:e], self.A_log, self.dt_bias,
                heads=(hk, hv, kd, vd), conv=self.ops.gdn_conv, recurrence=self.ops.gdn_recurrence,
            )  # fmt: skip
            outs.append(o.to(mixed_qkv.dtype))
        if not outs:
            return mixed_qkv.new_zeros(0, hv, vd)
        return torch.cat(outs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_context: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        """[s, b, H] -> ([s, b, H], None), Megatron's attention contract."""
        if attention_mask is not None:
            raise CanonicalSiteError(
                "canonical GDN is causal from sequence boundaries: pass attention_mask=None "
                "and express padding/packing with PackedSeqParams"
            )
        if inference_context is not None:
            raise CanonicalSiteError("Megatron inference (GDN state caching) is not canonical")
        if attention_bias is not None:
            raise CanonicalSiteError("attention bias in a GDN layer")
        s, bsz, h = hidden_states.shape
        x, starts = packed_bounds(hidden_states, packed_seq_params)
        mixed_qkvz, _ = self.in_proj_qkvz(x)
        ba, _ = self.in_proj_ba(x)
        mixed_qkv, z, b, a = self.split_projections(mixed_qkvz, ba)
        core = self.core(mixed_qkv, b, a, starts)
        out, _ = self.out_proj(self.norm(core, z).reshape(x.shape[0], -1))
        if packed_seq_params is not None:
            return out.reshape(s, bsz, h), None
        return out.reshape(bsz, s, h).transpose(0, 1).contiguous(), None


class IsoGatedSelfAttention(SelfAttention):
    """Qwen3-Next full attention: Megatron's `SelfAttention` with `attention_output_gate`,
    whose gate is the engine's `out * sigmoid(gate)` in the model dtype (Megatron computes
    `x * sigmoid(gate.float())` and rounds once, a different result, with a length-dependent
    CPU sigmoid)."""

    isoexec_impl: ImplInfo

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        if not config.attention_output_gate:
            raise CanonicalSiteError("IsoGatedSelfAttention needs config.attention_output_gate")
        super().__init__(config, *args, **kwargs)
        # the gate has one implementation, torch's, on every backend (as on the engine)
        gate = SiteBinding("attn_output_gate", impl=ATTN_OUTPUT_GATE_IMPL)
        bind(self, gate, ops_attr="isoexec_ops")

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.isoexec_ops.attn_output_gate(x, gate.contiguous().view(*x.shape))


__all__ = [
    "ATTN_OUTPUT_GATE_IMPL",
    "GDNSubmodules",
    "IsoGatedDeltaNet",
    "IsoGatedRMSNorm",
    "IsoGatedSelfAttention",
    "attn_output_gate",
    "packed_bounds",
]
