"""Megatron-core modules whose numerics are IsoExec's canonical ops, for the ModuleSpec slots.

The engine side (`isoexec.vllm.layers`, `attention`, `sampler`) calls `isoexec.ops` at
every site; each class here calls the same op, with the same dtypes, the same weight layout
and the same roundings, so the trainer's logprobs are the engine's bit for bit. Every class
subclasses (or replaces, constructor-compatible) the Megatron module of its slot, so weight
names, `load_hf_weights` / `export_hf_weights` and the optimizer see the same parameters.
The model is never patched: the classes enter through `Submodules` (the layer spec),
`IsoTransformerConfig` and `IsoGPTModel` (the process-wide writes into Megatron, the CPU shims
and the RoPE trace wrapper, are declared patches: `isoexec.megatron.patches.REGISTRY`).

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

The modules live per op, as on the engine: `canonical_base` (config, refusal error, site impls),
`layers` (linears, norms, activation), `attention`, `moe`, and
Qwen3-Next's GDN layer, gated norm and gated attention in `gdn`; this module holds
the model (`IsoGPTModel`) and re-exports the rest.
"""

from __future__ import annotations

from typing import Any

from isoexec.contract.impl import ImplInfo
from isoexec.megatron.attention import (
    IsoCoreAttention,
    packed_positions,
)
from isoexec.megatron.canonical_base import (
    LM_HEAD_ROW_PADDING,
    CanonicalSiteError,
    IsoTransformerConfig,
    _tp_size,
    bind,
    site_backend,
    site_binding,
)
from isoexec.megatron.layers import (
    IsoColumnParallelLinear,
    IsoOutputLayer,
    IsoQKVLinear,
    IsoRMSNorm,
    IsoRowParallelLinear,
    IsoSiluMul,
    qkv_hf_row_order,
)
from isoexec.megatron.moe import (
    IsoMoELayer,
    IsoSequentialMLP,
    IsoSharedExpertMLP,
    IsoTopKRouter,
)
from megatron.core.models.gpt import GPTModel


# ---- the model -------------------------------------------------------------------------------
class IsoGPTModel(GPTModel):
    """`GPTModel` whose output layer is `IsoOutputLayer` and whose scorer is canonical.

    Built with `position_embedding_type="none"` by `build_model`: RoPE is canonical inside the
    core attention. Its `isoexec_impl` (logprobs) is what `scoring.score` runs, through
    `isoexec_ops`.
    """

    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        mode = getattr(self.config, "isoexec_logprobs_mode", "processed_logprobs")
        self.isoexec_logprobs_mode = mode  # raw_logprobs: scored at T=1 (scoring.py)
        # what scoring's logprobs run (`isoexec_ops`) and record, from one binding
        bind(self, site_binding(self.config, "logprobs", mode=mode), ops_attr="isoexec_ops")
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
    "_tp_size",
    "bind",
    "packed_positions",
    "qkv_hf_row_order",
    "site_backend",
    "site_binding",
]
