"""Megatron-core modules whose numerics are IsoExec's canonical ops, for the ModuleSpec slots.

The engine side (`isoexec.vllm.layers`, `attention`, `sampler`) calls `isoexec.contract.ops` at
every site; each class here calls the same op, with the same dtypes, the same weight layout
and the same roundings, so the trainer's logprobs are the engine's bit for bit. Every class
subclasses (or replaces, constructor-compatible) the Megatron module of its slot, so weight
names, `load_hf_weights` / `export_hf_weights` and the optimizer see the same parameters.
Megatron itself is never patched: the classes enter through `Submodules` (the layer spec),
`IsoTransformerConfig` and `IsoGPTModel`.

Each instance carries `isoexec_impl` (the `ImplInfo` of the op it runs) or `isoexec_impls`
(op -> ImplInfo, for a module that runs several); the contract is read back from these.

Where Megatron's own structure and vLLM's differ, the rounding sequence of vLLM is followed:
- residual adds: Megatron's `bias_dropout_add` computes `residual + out` in the model dtype,
  vLLM's fused norm `x + residual` in the model dtype: the same IEEE sum, so the norms here
  take no residual;
- QKV: Megatron keeps rows interleaved per query group, vLLM as [q; k; v]; the GEMM runs on
  the vLLM row order (an exact permutation of the weight) and the columns are put back;
- lm head: vLLM pads the vocab to a multiple of 64 rows; so does the GEMM here;
- RoPE: the model is built without Megatron's rotary embedding and the canonical core
  attention applies `rope_cos_sin` + `apply_rope` per packed sequence (positions from 0), as
  vLLM's rotary embedding does on `[T, H, D]` views, then `attention_varlen` with vLLM's
  scale `head_dim ** -0.5` and the default KV tile;
- MoE: router logits by the canonical linear in the model dtype, `moe_router`, then
  `moe_combine` on experts stacked as the engine holds them: w13 [E, 2I, H] = cat(gate, up),
  w2 [E, H, I]; a (Qwen3-Next) sigmoid-gated shared expert goes into the same combine.

Qwen3-Next's GDN layer, gated norm and gated attention are in `canonical_gdn`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from isoexec.contract import ops
from isoexec.contract.impl import ImplInfo
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_config import TransformerConfig

# vLLM's DEFAULT_VOCAB_PADDING_SIZE: the engine's lm-head weight has this many rows per block.
LM_HEAD_ROW_PADDING = 64


class CanonicalSiteError(RuntimeError):
    """A slot was asked for something its canonical op cannot express: refused, no fallback."""


@dataclass
class IsoTransformerConfig(TransformerConfig):
    """`TransformerConfig` plus the RoPE base the canonical core attention applies.

    Why a field: `SelfAttention` constructs its core attention with a fixed set of arguments,
    and the isoexec model has no Megatron rotary embedding (RoPE is canonical, in the core
    attention), so the base travels with the config.
    """

    isoexec_rope_theta: float | None = None
    # Rotated dims per head (partial RoPE, Qwen3-Next); None: the whole head.
    isoexec_rotary_dim: int | None = None
    # Row-parallel sites (o_proj, down_proj): None = `ops.linear` (TP=1 only); G = the
    # TP-invariant `linear_tp` with K in G fixed leaves, bitwise the same for every TP | G.
    isoexec_tp_leaves: int | None = None
    # Which backend's kernels every site runs (`ops.BACKENDS`): "torch" or "triton".
    isoexec_backend: str = "torch"
    # vLLM's name of the logprobs the trainer scores (`IsoExecOptions.logprobs_mode`).
    isoexec_logprobs_mode: str = "processed_logprobs"


def site_backend(config: TransformerConfig) -> str:
    """The backend this model's sites run (IsoTransformerConfig.isoexec_backend)."""
    backend = getattr(config, "isoexec_backend", ops.BACKEND)
    if backend not in ops.BACKENDS:
        raise CanonicalSiteError(f"unknown backend {backend!r}; known: {list(ops.BACKENDS)}")
    return str(backend)


def site_ops(config: TransformerConfig) -> ModuleType:
    """The module whose functions a site calls: `ops` itself, or the Triton twin."""
    return ops.backend_ops(site_backend(config))


def site_impl(config: TransformerConfig, op: str, **params: object) -> ImplInfo:
    """What a site of this config records for `op` (backend included)."""
    return ops.get_backend_impl(op, site_backend(config), **params)


def _tp_size(module: torch.nn.Module) -> int:
    """The module's own TP degree: its group's size (a whole shared expert's linears sit in a
    size-1 group inside a TP=2 model), else the config's."""
    group = getattr(module, "tp_group", None)
    if group is not None:
        return int(group.size())
    return int(module.config.tensor_model_parallel_size)  # type: ignore[union-attr]


# ---- linear layers ---------------------------------------------------------------------------
class IsoColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linear whose GEMM is `ops.linear` on this rank's rows of the weight.

    TP-invariant as it is: `ops.linear` computes every output column from that column's
    weight row alone (its K order does not depend on N; tests/ops test_linear_column_split),
    so a rank's columns carry the TP=1 bits. Megatron's autograd regions are kept: the input
    is copied into the TP region (its gradient all-reduced), a gathered output is an exact
    concatenation.
    """

    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ops = site_ops(self.config)
        self.isoexec_impl = site_impl(self.config, "linear")

    def _weight_for_gemm(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def _columns_back(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, bias-if-skip_bias_add), Megatron's contract; bias added after the GEMM."""
        w = self.weight if weight is None else weight
        if w is None:
            raise CanonicalSiteError("output layer without a weight (tied weight not passed)")
        bias = None if self.skip_bias_add else self.bias
        tp = _tp_size(self)
        if tp > 1:
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = self._columns_back(self.ops.linear(input_, self._weight_for_gemm(w)))
        if bias is not None:
            out = out + bias.to(out.dtype)  # ops.linear's bias rule: after the one rounding
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if tp > 1 and gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class IsoRowParallelLinear(RowParallelLinear):
    """Row-parallel linear (o_proj, down_proj): this rank holds the K-slice of the weight.

    Without `isoexec_tp_leaves` it is `ops.linear` on the whole weight (TP=1 only: a K split
    changes the reduction order). With G leaves it is the TP-invariant `linear_tp`: each rank
    computes fp32 partial products of its G/TP fixed K-leaves, the leaves are all-gathered in
    rank order (an exact copy) and summed in `ops.tp_tree_sum`'s fixed tree, then rounded once:
    the same bits for TP=1, 2, 4, ... (any TP dividing G).
    """

    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ops = site_ops(self.config)
        self.isoexec_impl = site_impl(self.config, "linear")
        leaves = getattr(self.config, "isoexec_tp_leaves", None)
        self.tp_leaves: int | None = None if leaves is None else int(leaves)
        tp = _tp_size(self)
        if self.tp_leaves is None:
            if tp != 1:
                raise CanonicalSiteError(
                    f"{type(self).__name__} at TP={tp}: a K-split `ops.linear` is not "
                    "TP-invariant; build with tp_invariant=True (the `linear_tp` leaves)"
                )
        else:
            if site_backend(self.config) != ops.BACKEND:
                raise CanonicalSiteError("tp_invariant with the Triton backend is not wired")
            if self.tp_leaves % tp or self.input_size_per_partition % (self.tp_leaves // tp):
                raise CanonicalSiteError(
                    f"linear_tp leaves={self.tp_leaves} do not split TP={tp} x K-shard "
                    f"{self.input_size_per_partition}"
                )
            self.isoexec_impl = ops.get_impl("linear_tp", leaves=self.tp_leaves)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = self.bias if self.bias is not None and not self.skip_bias_add else None
        if self.tp_leaves is None:
            out = self.ops.linear(input_, self.weight, bias)
        else:
            out = self._leaf_linear(input_, bias)
        return out, (self.bias if self.skip_bias_add else None)

    def _leaf_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.tp_leaves is not None
        return ops.linear_tp_shard(
            x, self.weight, bias, tp=_tp_size(self), all_gather=self._gather_leaves,
            leaves=self.tp_leaves,
        )  # fmt: skip

    def _gather_leaves(self, parts: torch.Tensor) -> torch.Tensor:
        """[G/tp, M, N] -> [G, M, N] in rank order, through Megatron's gather region along the
        last dim (its backward takes this rank's slice, so gradients flow)."""
        return gather_from_tensor_model_parallel_region(
            parts.permute(1, 2, 0).contiguous(), group=self.tp_group
        ).permute(2, 0, 1)


def qkv_hf_row_order(
    num_heads: int, num_groups: int, head_dim: int, *, output_gate: bool = False
) -> torch.Tensor:
    """Row index `perm` with `W_hf = W_megatron[perm]`: Megatron's per-group
    [q heads of g; k_g; v_g] rows → HF/vLLM's [all q; all k; all v].

    With `output_gate` (Qwen3-Next) Megatron's group is [q heads of g; gate heads of g; k_g;
    v_g] and the HF/vLLM q block holds [q_h; gate_h] per head (`q_proj` is 2·head_dim per head).
    """
    qpg = num_heads // num_groups
    gates = qpg if output_gate else 0
    per_group = (qpg + gates + 2) * head_dim
    q, k, v = [], [], []
    for g in range(num_groups):
        base = g * per_group
        for j in range(qpg):
            q.append(torch.arange(base + j * head_dim, base + (j + 1) * head_dim))
            if output_gate:
                gbase = base + (qpg + j) * head_dim
                q.append(torch.arange(gbase, gbase + head_dim))
        kbase = base + (qpg + gates) * head_dim
        k.append(torch.arange(kbase, kbase + head_dim))
        v.append(torch.arange(kbase + head_dim, kbase + 2 * head_dim))
    return torch.cat(q + k + v)


class IsoQKVLinear(IsoColumnParallelLinear):
    """The fused QKV projection, computed as vLLM's `QKVParallelLinear` computes it.

    Why: a GEMM's bits per output column are only guaranteed for the same weight layout, and
    vLLM's QKV weight is [q; k; v] while Megatron's is interleaved per query group. The GEMM
    runs on the exactly permuted weight and its output columns are permuted back (both pure
    reshuffles); autograd flows through both.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        tp = _tp_size(self)  # this rank holds whole query groups: permute within them
        perm = qkv_hf_row_order(
            c.num_attention_heads // tp,
            c.num_query_groups // tp,
            c.kv_channels,
            output_gate=bool(c.attention_output_gate),
        )
        if perm.numel() != self.output_size_per_partition:
            raise CanonicalSiteError(
                f"QKV rows {self.output_size_per_partition} != heads/groups layout {perm.numel()}"
            )
        self.register_buffer("_hf_rows", perm, persistent=False)
        self.register_buffer("_megatron_cols", torch.argsort(perm), persistent=False)

    def _weight_for_gemm(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.index_select(0, self._hf_rows)

    def _columns_back(self, out: torch.Tensor) -> torch.Tensor:
        return out.index_select(-1, self._megatron_cols)


class IsoOutputLayer(IsoColumnParallelLinear):
    """The lm head: canonical linear over the vocab padded to vLLM's 64-row multiple.

    Row-invariant, so computing every position (the engine only computes sampled rows) gives
    the same bits per row; the padding rows are zero and sliced off.
    """

    def _weight_for_gemm(self, weight: torch.Tensor) -> torch.Tensor:
        pad = -weight.shape[0] % LM_HEAD_ROW_PADDING
        return torch.nn.functional.pad(weight, (0, 0, 0, pad)) if pad else weight

    def _columns_back(self, out: torch.Tensor) -> torch.Tensor:
        return out[..., : self.output_size_per_partition]


# ---- norms, activation -----------------------------------------------------------------------
class IsoRMSNorm(torch.nn.Module):
    """RMSNorm slot (input / pre-MLP / final / q / k norm) → `ops.rms_norm`.

    Takes no residual: Megatron adds it in the layer, with the same bits as vLLM's fused add.
    Constructor-compatible with `WrappedTorchNorm`; the weight is created in the model dtype,
    as HF and vLLM hold it.
    """

    isoexec_impl: ImplInfo

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise CanonicalSiteError(f"normalization {config.normalization!r} is not RMSNorm")
        if config.sequence_parallel or config.memory_efficient_layer_norm:
            raise CanonicalSiteError("sequence-parallel / memory-efficient norm not canonical")
        self.eps = float(eps)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma or zero_centered_gamma)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.ops = site_ops(config)
        self.isoexec_impl = site_impl(config, "rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.rms_norm(x, self.weight, self.eps, zero_centered=self.zero_centered)
        assert isinstance(y, torch.Tensor)
        return y


class IsoSiluMul(torch.nn.Module):
    """MLP activation slot (`MLPSubmodules.activation_func`): `ops.silu_mul` on fc1's
    [gate | up] output, fp32, one rounding (Megatron's own glu rounds silu first)."""

    isoexec_impl: ImplInfo

    def __init__(self, config: TransformerConfig, **_: Any) -> None:
        super().__init__()
        if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
            raise CanonicalSiteError("canonical activation is SwiGLU (gated silu) only")
        self.ops = site_ops(config)
        self.isoexec_impl = site_impl(config, "silu_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(x)


# ---- attention -------------------------------------------------------------------------------
def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed row inside its own sequence (0 at each cu_seqlens start)."""
    cu = cu_seqlens.to(torch.int64).cpu()
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lens < 0).any()):
        raise CanonicalSiteError(f"cu_seqlens {cu.tolist()} do not cover {total} packed rows")
    starts = torch.repeat_interleave(cu[:-1], lens)
    return torch.arange(total) - starts


class IsoCoreAttention(MegatronModule):
    """Core attention slot: canonical RoPE then `ops.attention_varlen` (causal, GQA).

    Reads packed sequences (`PackedSeqParams`, qkv_format 'thd': q/k/v [T, H, D]) or Megatron's
    [s, b, H, D] (each batch row one sequence from position 0). RoPE is applied here because
    the isoexec model has no Megatron rotary embedding: Megatron's `apply_rotary_pos_emb`
    (freqs table + its own rounding) is not the canonical rope.
    """

    isoexec_impls: dict[str, ImplInfo]

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
        self.ops = site_ops(config)
        self.isoexec_impls = {
            "attention": site_impl(config, "attention"),
            "rope": site_impl(config, "rope"),
        }
        self.head_dim = int(config.kv_channels)
        rotary_dim = getattr(config, "isoexec_rotary_dim", None)
        self.rotary_dim = self.head_dim if rotary_dim is None else int(rotary_dim)
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise CanonicalSiteError(f"rotary dim {self.rotary_dim} for head dim {self.head_dim}")
        self.rope_theta = float(theta)  # type: ignore[arg-type]
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
        """q [T, H, D], k/v [T, Hkv, D]: rope (as vLLM's IsoRotaryEmbedding), then attention."""
        pos = packed_positions(cu, q.shape[0]).to(q.device)
        rot = getattr(self, "rotary_dim", self.head_dim)
        o = self.ops
        cos, sin = o.rope_cos_sin(pos, rot, self.rope_theta)
        q = o.apply_rope(q, cos, sin, rot)
        k = o.apply_rope(k, cos, sin, rot)
        return o.attention_varlen(q, k, v, cu.to(q.device), scale=self.scale)


# ---- MoE -------------------------------------------------------------------------------------
class IsoTopKRouter(TopKRouter):
    """Router slot: logits = `ops.linear(x, W_router)` in the model dtype (vLLM's gate is a
    plain linear layer), then `ops.moe_router` (fp32 softmax, stable top-k, optional renorm).

    `forward(x [T, H])` returns (weights fp32 [T, k], expert ids [T, k]) for `IsoMoELayer`.
    """

    isoexec_impl: ImplInfo

    def __init__(self, config: TransformerConfig, pg_collection: Any = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        problems = []
        if config.moe_router_score_function != "softmax":
            problems.append(f"score function {config.moe_router_score_function!r}")
        if config.moe_router_enable_expert_bias or self.bias is not None:
            problems.append("router bias")
        if config.moe_router_topk_scaling_factor not in (None, 1.0):
            problems.append("top-k scaling factor")
        if config.moe_router_num_groups or config.moe_router_group_topk:
            problems.append("group-limited routing")
        if config.moe_expert_capacity_factor is not None:
            problems.append("token dropping")
        if config.moe_input_jitter_eps:
            problems.append("input jitter")
        if problems:
            raise CanonicalSiteError("canonical router does not support: " + ", ".join(problems))
        # transformer_config(): moe_router_pre_softmax = not norm_topk_prob.
        self.renormalize = not config.moe_router_pre_softmax
        self.ops = site_ops(config)
        self.isoexec_impl = site_impl(config, "moe_router")

    def forward(self, x: torch.Tensor, padding_mask: Any = None) -> Any:  # type: ignore[override]
        logits = self.ops.linear(x, self.weight)
        return self.ops.moe_router(logits, self.topk, renormalize=self.renormalize)


class IsoSequentialMLP(SequentialMLP):
    """Experts slot: same parameters as `SequentialMLP` (so HF weight names map unchanged),
    computed by `ops.moe_combine` on the experts stacked in the engine's layout."""

    isoexec_impl: ImplInfo

    def __init__(self, num_local_experts: int, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(num_local_experts, config, **kwargs)
        # Expert parallelism: this rank holds experts first_expert .. (Megatron's split).
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        self.first_expert = ep_rank * num_local_experts
        etp = config.expert_tensor_parallel_size
        if etp not in (None, 1):
            raise CanonicalSiteError(
                f"expert tensor parallelism {etp}: experts must be whole on every TP rank "
                "(megatron_parallel() sets expert_tensor_parallel_size=1)"
            )
        self.ops = site_ops(config)
        self.isoexec_impl = site_impl(config, "moe_combine")

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H] = cat(gate, up), w2 [E, H, I]): Megatron's fc1/fc2 rows as is."""
        w13 = torch.stack([e.linear_fc1.weight for e in self.local_experts])
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])
        return w13, w2

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        **shared: torch.Tensor,
    ) -> torch.Tensor:
        """`shared`: `shared_w13`, `shared_w2`, `shared_gate_w` of `ops.moe_combine`."""
        w13, w2 = self.stacked_weights()
        return self.ops.moe_combine(x, topk_weights, topk_ids, w13, w2, **shared)

    def local_outputs(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k, H] outputs of this rank's experts, -0.0 in slots routed to other ranks."""
        w13, w2 = self.stacked_weights()
        return self.ops.moe_experts(x, topk_ids, w13, w2, first_expert=self.first_expert)


class IsoSharedExpertMLP(SharedExpertMLP):
    """Shared-expert slot: Megatron's parameters (fc1 = cat(gate, up), fc2, `gate_weight`
    [1, H]), computed inside `ops.moe_combine` by `IsoMoELayer` (the engine adds the shared
    expert inside the same fixed-order fp32 combine); its own forward is never canonical.

    Whole and replicated on every TP rank, like the routed experts at expert TP = 1: its
    linears are built in the expert-TP group (size 1) instead of Megatron's TP group, and their
    `tensor_model_parallel` marks are cleared (the weights load, export and count in grad
    norms as replicated). Gradients need no TP reduction: every rank computes the whole MoE
    layer from the same full input and the same full output gradient.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Any,
        gate: bool,
        pg_collection: Any = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        whole = copy.copy(pg_collection)
        expt_tp = getattr(pg_collection, "expt_tp", None)
        whole.tp = expt_tp if expt_tp is not None else ps.get_expert_tensor_parallel_group()
        if whole.tp.size() != 1:
            raise CanonicalSiteError(
                f"expert tensor parallelism {whole.tp.size()}: the shared expert must be whole "
                "on every TP rank (megatron_parallel() sets expert_tensor_parallel_size=1)"
            )
        super().__init__(config, submodules, gate, pg_collection=whole)
        for linear in (self.linear_fc1, self.linear_fc2):
            for p in linear.parameters():
                p.tensor_model_parallel = False  # type: ignore[attr-defined]
                p.partition_dim = -1  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise CanonicalSiteError("the shared expert runs inside ops.moe_combine (IsoMoELayer)")

    def combine_kwargs(self) -> dict[str, torch.Tensor]:
        """The `shared_*` arguments of `ops.moe_combine`, the engine's layouts as is."""
        out = {"shared_w13": self.linear_fc1.weight, "shared_w2": self.linear_fc2.weight}
        if self.gate_weight is not None:
            out["shared_gate_w"] = self.gate_weight
        return out


class IsoMoELayer(MoELayer):
    """MoE block: route and combine canonically on [T, H], no token dispatcher.

    Every token's result depends only on its own row (canonical linear is row-invariant, the
    combine is a fixed ascending-expert sum), so packing and padding cannot change it. At
    EP>1 the routed experts' per-slot outputs are exchanged over the EP group
    (`expert_parallel`), and the combine stays local and canonical.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_shared_expert and not isinstance(self.shared_experts, IsoSharedExpertMLP):
            raise CanonicalSiteError(
                f"shared experts {type(self.shared_experts).__name__}: only IsoSharedExpertMLP "
                "(computed inside ops.moe_combine) is canonical"
            )
        if self.use_shared_expert and self.shared_expert_overlap:
            raise CanonicalSiteError("overlapped shared experts are not canonical")
        shared = self.shared_experts
        if self.use_shared_expert and (
            _tp_size(shared.linear_fc1) != 1 or _tp_size(shared.linear_fc2) != 1
        ):
            raise CanonicalSiteError("a TP-sharded shared expert: ops.moe_combine needs it whole")
        for name, mod in (("router", self.router), ("experts", self.experts)):
            if not hasattr(mod, "isoexec_impl"):
                raise CanonicalSiteError(f"IsoMoELayer needs a canonical {name}, got {mod!r}")

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        if intermediate_tensors is not None:
            raise CanonicalSiteError("partial MoE forward (CUDA-graph pieces) is not canonical")
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, ids = self.router(x)
        shared = self.shared_experts.combine_kwargs() if self.use_shared_expert else {}
        if self.ep_group is None or self.ep_group.size() == 1:
            out = self.experts(x, weights, ids, **shared)
        else:
            from isoexec.megatron.expert_parallel import exchange_expert_outputs

            y = exchange_expert_outputs(x, ids, self.experts.local_outputs, self.ep_group)
            w13, w2 = self.experts.stacked_weights()  # unused: the outputs are given
            out = self.experts.ops.moe_combine(x, weights, ids, w13, w2, expert_out=y, **shared)
        return out.reshape(hidden_states.shape), None


# ---- the model -------------------------------------------------------------------------------
class IsoGPTModel(GPTModel):
    """`GPTModel` whose output layer is `IsoOutputLayer` and whose scorer is canonical.

    Built with `position_embedding_type="none"` by `build_model`: RoPE is canonical inside the
    core attention. `isoexec_impls["logprobs"]` is what `scoring.score` runs.
    """

    isoexec_impls: dict[str, ImplInfo]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.isoexec_ops = site_ops(self.config)  # what scoring's logprobs run
        mode = getattr(self.config, "isoexec_logprobs_mode", "processed_logprobs")
        self.isoexec_logprobs_mode = mode  # raw_logprobs: scored at T=1 (scoring.py)
        self.isoexec_impls = {"logprobs": site_impl(self.config, "logprobs", mode=mode)}
        if self.position_embedding_type != "none":
            raise CanonicalSiteError(
                "IsoGPTModel applies RoPE in the canonical core attention; build it with "
                "position_embedding_type='none' (Megatron's RoPE would apply it twice)"
            )
        if not self.post_process:
            return  # an earlier pipeline stage: no output layer, no logprobs here
        old = self.output_layer
        new = IsoOutputLayer(
            self.config.hidden_size,
            self.vocab_size,
            config=self.config,
            init_method=self.config.init_method,
            bias=False,
            skip_bias_add=False,
            # Full-vocab logits on every rank (an exact gather at TP>1): the logprobs are then
            # the canonical `ops.token_logprobs` over the whole row, as at TP=1 and on the engine.
            gather_output=True,
            skip_weight_param_allocation=self.pre_process
            and self.share_embeddings_and_output_weights,
            embedding_activation_buffer=self.embedding_activation_buffer,
            grad_output_buffer=self.grad_output_buffer,
            tp_group=self.pg_collection.tp,
        )
        if old.weight is not None:
            new.weight = old.weight  # the same Parameter, with the attributes Megatron set
        self.output_layer = new


__all__ = [
    "LM_HEAD_ROW_PADDING",
    "CanonicalSiteError",
    "IsoColumnParallelLinear",
    "IsoCoreAttention",
    "IsoGPTModel",
    "IsoMoELayer",
    "IsoOutputLayer",
    "IsoQKVLinear",
    "IsoRMSNorm",
    "IsoRowParallelLinear",
    "IsoSequentialMLP",
    "IsoSharedExpertMLP",
    "IsoSiluMul",
    "IsoTopKRouter",
    "IsoTransformerConfig",
    "packed_positions",
    "qkv_hf_row_order",
]
