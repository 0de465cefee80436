"""Canonical linear layers (column/row parallel, QKV, lm head), RMSNorm and SiLU-and-mul for
the Megatron ModuleSpec slots: the trainer's side of `isoexec.vllm.layers`."""

from __future__ import annotations

from typing import Any

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.megatron.canonical_base import (
    LM_HEAD_ROW_PADDING,
    CanonicalSiteError,
    _tp_size,
    bind,
    site_binding,
)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.transformer_config import TransformerConfig


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
        bind(self, site_binding(self.config, "linear"))

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
    the same bits for TP=1, 2, 4, ... (any TP dividing G). The leaves run on the site's backend
    (`site_binding`: the torch block GEMM or the Triton kernel, whose backward is the torch
    leaves'); the gather, tree and rounding are the same torch ops on both.
    """

    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        bind(self, site_binding(self.config, "linear"))
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
            if self.tp_leaves % tp or self.input_size_per_partition % (self.tp_leaves // tp):
                raise CanonicalSiteError(
                    f"linear_tp leaves={self.tp_leaves} do not split TP={tp} x K-shard "
                    f"{self.input_size_per_partition}"
                )
            bind(self, site_binding(self.config, "linear_tp", leaves=self.tp_leaves))

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = self.bias if self.bias is not None and not self.skip_bias_add else None
        if self.tp_leaves is None:
            out = self.ops.linear(input_, self.weight, bias)
        else:
            out = self._leaf_linear(input_, bias)
        return out, (self.bias if self.skip_bias_add else None)

    def _leaf_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.tp_leaves is not None
        # The site's backend (torch, or the Triton leaves with the torch leaves' backward).
        return self.ops.linear_tp_shard(
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
        bind(self, site_binding(config, "rms_norm"))

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
        bind(self, site_binding(config, "silu_mul"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(x)
