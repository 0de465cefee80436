"""Build a Megatron-core `GPTModel` whose forward pass is the HF architecture's, exactly.

Two pieces of data decide the model:
- `transformer_config(arch, ...)` → a `TransformerConfig` (sizes, GQA, norms, RoPE, routing);
- `block_spec(arch, submodules)` → a `TransformerBlockSubmodules` (one `ModuleSpec` per layer:
  dense layers get `MLP`, sparse layers get `MoELayer` with `SequentialMLP` experts).

`Submodules` is the extension point for IsoExec: it names the class that fills every slot of a
layer (linears, norms, core attention, activation, MoE layer, router, experts) and the model
class. `native_submodules()` is Megatron's own local (no-TE) implementation;
`isoexec_submodules()` the canonical one (`canonical_modules`), selected by
`build_model(..., isoexec=True)`. A new architecture adds a `LayerSpecBuilder` to
`_LAYER_SPEC_BUILDERS`.

The GDN hybrids, Qwen3-Next and Qwen3.5 text: their linear-attention layers put a GDN layer
in the `self_attention` slot, their full-attention layers Megatron's `SelfAttention` with
`attention_output_gate`; Qwen3-Next's MoE layers get a gated shared expert, Qwen3.5's layers a
dense MLP; norms are zero-centred (`layernorm_zero_centered_gamma`). isoexec mode:
`canonical_gdn.IsoGatedDeltaNet` and `IsoGatedSelfAttention`. Native mode: Megatron's own
`GatedDeltaNet` (fused `in_proj` [q | k | v | z | b | a], `conv1d`, `out_norm` with HF's plain
gain, `out_proj`) and `SelfAttention`, stock; on a CPU it runs through three shims in
`cpu_shims` (zero-centred torch RMSNorm for TE's, torch stand-ins for fla's `l2norm` and
chunked delta rule, CPU allocation). Megatron's `GatedDeltaNet` refuses packed (THD)
sequences, which native scoring never sends (one sequence per forward, see `scoring`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from isoexec.contract.options import IsoExecOptions
from isoexec.megatron.hf_config import (
    SUPPORTED_ARCHITECTURES,
    HFConfigSource,
    ModelArch,
    load_hf_config,
)


@dataclass(frozen=True)
class Submodules:
    """The class in each slot of a decoder layer. IsoExec substitutes canonical modules here.

    Every field is a Megatron-compatible module class (same constructor and forward contract as
    the native one it replaces), so the rest of the spec, and the weight names, stay the same.
    """

    norm: type  # input / pre-MLP / final RMSNorm (hidden_size)
    qk_norm: type  # per-head RMSNorm on q and k (head_dim)
    linear_qkv: type  # column-parallel
    core_attention: type
    linear_proj: type  # row-parallel
    linear_fc1: type  # column-parallel, [gate; up]
    linear_fc2: type  # row-parallel
    expert_linear_fc1: type
    expert_linear_fc2: type
    experts: type  # container of the routed experts
    router: type
    name: str = "native"
    # None: Megatron's own glu on `config.activation_func`; a class: built from the MLP spec.
    activation: type | None = None
    moe_layer: type | None = None  # None: Megatron's MoELayer
    model: type | None = None  # None: GPTModel
    # True: the model has no Megatron rotary embedding (the core attention applies RoPE).
    rope_in_core_attention: bool = False
    # Qwen3-Next slots; None: this set of modules cannot build that part.
    gated_attention: type | None = None  # SelfAttention with attention_output_gate
    linear_attention: type | None = None  # GDN layer in the self_attention slot
    gated_norm: type | None = None  # GDN output norm norm(x)·w·silu(z)
    shared_experts: type | None = None  # gated shared expert of a MoE layer


def native_submodules() -> Submodules:
    """Megatron-core's local (no Transformer Engine, no apex) modules.

    GDN hybrids: Megatron's `GatedDeltaNet` (its output norm a `WrappedTorchNorm`), the gated
    `SelfAttention` and `SharedExpertMLP`, as they are.
    """
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return Submodules(
        norm=WrappedTorchNorm,
        qk_norm=WrappedTorchNorm,
        linear_qkv=ColumnParallelLinear,
        core_attention=DotProductAttention,
        linear_proj=RowParallelLinear,
        linear_fc1=ColumnParallelLinear,
        linear_fc2=RowParallelLinear,
        expert_linear_fc1=ColumnParallelLinear,
        expert_linear_fc2=RowParallelLinear,
        experts=SequentialMLP,
        router=TopKRouter,
        name="native",
        gated_attention=SelfAttention,
        linear_attention=GatedDeltaNet,
        gated_norm=WrappedTorchNorm,
        shared_experts=SharedExpertMLP,
    )


def isoexec_submodules() -> Submodules:
    """The canonical IsoExec modules (`isoexec.megatron.canonical_modules`) in every slot."""
    from isoexec.megatron import canonical_gdn as gdn
    from isoexec.megatron import canonical_modules as cm

    return Submodules(
        norm=cm.IsoRMSNorm,
        qk_norm=cm.IsoRMSNorm,
        linear_qkv=cm.IsoQKVLinear,
        core_attention=cm.IsoCoreAttention,
        linear_proj=cm.IsoRowParallelLinear,
        linear_fc1=cm.IsoColumnParallelLinear,
        linear_fc2=cm.IsoRowParallelLinear,
        expert_linear_fc1=cm.IsoColumnParallelLinear,
        expert_linear_fc2=cm.IsoRowParallelLinear,
        experts=cm.IsoSequentialMLP,
        router=cm.IsoTopKRouter,
        name="isoexec",
        activation=cm.IsoSiluMul,
        moe_layer=cm.IsoMoELayer,
        model=cm.IsoGPTModel,
        rope_in_core_attention=True,
        gated_attention=gdn.IsoGatedSelfAttention,
        linear_attention=gdn.IsoGatedDeltaNet,
        gated_norm=gdn.IsoGatedRMSNorm,
        shared_experts=cm.IsoSharedExpertMLP,
    )


# ------------------------------------------------------------------------------------------
# TransformerConfig
# ------------------------------------------------------------------------------------------


def transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    dtype: torch.dtype = torch.float32,
    sub: Submodules | None = None,
    tp_leaves: int | None = None,
    backend: str = "torch",
    pp: int = 1,
    ep: int = 1,
    initialize: bool = True,
    logprobs_mode: str = "processed_logprobs",
) -> Any:
    """The `TransformerConfig` reproducing `arch` (Qwen3 family), with every fusion off.

    Fusions are off because they need CUDA/TE/apex and because IsoExec must know which kernel
    runs at each site. Dropout follows the HF config (0 for Qwen3), so scoring is deterministic.
    With canonical submodules (`sub.rope_in_core_attention`) it is an `IsoTransformerConfig`
    carrying the RoPE base, and the activation is built from the MLP spec
    (`use_te_activation_func`, Megatron's switch for "activation module from the spec").
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} not supported (float32, bfloat16, float16)")
    _check_tp(arch, tp)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,
        # PP>1: stages exchange hidden states in the model dtype, one p2p op at a time (gloo
        # has no batched isend/irecv).
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        batch_p2p_comm=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        # No fused kernels: they need CUDA/TE/apex and would hide which kernel runs.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        # HF softmaxes attention in fp32 and keeps the residual in the model dtype.
        attention_softmax_in_fp32=True,
        fp32_residual_connection=False,
    )
    if arch.is_moe:
        assert arch.moe is not None
        kwargs.update(
            num_moe_experts=arch.moe.num_experts,
            moe_router_topk=arch.moe.top_k,
            moe_ffn_hidden_size=arch.moe.intermediate_size,
            moe_layer_freq=[1 if m else 0 for m in arch.moe_layers],
            moe_router_score_function="softmax",
            # norm_topk_prob: topk over logits then softmax over the k == renormalised top-k
            # probabilities; without it: softmax over all experts, then topk.
            moe_router_pre_softmax=not arch.moe.norm_topk_prob,
            moe_router_topk_scaling_factor=None,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
            moe_router_enable_expert_bias=False,
            moe_router_dtype=None,  # like HF: router logits in the model dtype
            moe_grouped_gemm=False,
            # allgather: the alltoall dispatcher creates a torch.cuda.Stream at construction.
            moe_token_dispatcher_type="allgather",
            moe_shared_expert_intermediate_size=None,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            expert_tensor_parallel_size=1,  # as megatron_parallel() sets it
            expert_model_parallel_size=ep,
        )
        if arch.moe.shared_expert_intermediate_size:
            kwargs.update(
                moe_shared_expert_intermediate_size=arch.moe.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,
                moe_shared_expert_overlap=False,
            )
    if arch.zero_centered_norms:
        kwargs["layernorm_zero_centered_gamma"] = True
    if arch.attn_output_gate:
        kwargs["attention_output_gate"] = True
    if arch.gdn is not None:
        kwargs.update(
            linear_conv_kernel_dim=arch.gdn.conv_kernel,
            linear_key_head_dim=arch.gdn.key_head_dim,
            linear_value_head_dim=arch.gdn.value_head_dim,
            linear_num_key_heads=arch.gdn.num_key_heads,
            linear_num_value_heads=arch.gdn.num_value_heads,
        )
    if sub is not None and sub.activation is not None:
        kwargs["use_te_activation_func"] = True
    if sub is not None and sub.rope_in_core_attention:
        from isoexec.megatron.canonical_modules import IsoTransformerConfig

        return IsoTransformerConfig(
            **kwargs,
            isoexec_rope_theta=arch.rope_theta,
            isoexec_rotary_dim=arch.rotary_dim,
            isoexec_tp_leaves=tp_leaves,
            isoexec_backend=backend,
            isoexec_logprobs_mode=logprobs_mode,
        )
    if tp_leaves is not None or backend != "torch":
        raise ValueError(
            "tp_leaves / a kernel backend choose canonical ops: canonical modules only"
        )
    return TransformerConfig(**kwargs)


def _check_tp(arch: ModelArch, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    for what, n in (
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_kv_heads),
        ("vocab_size", arch.vocab_size),
        ("intermediate_size", arch.intermediate_size),
    ):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what}={n}")
    if arch.moe is not None and arch.moe.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide moe_intermediate_size")
    if arch.gdn is not None and arch.gdn.num_key_heads % tp:
        # A rank holds whole key-head groups with their value heads (canonical_gdn).
        raise ValueError(
            f"tp={tp} does not divide linear_num_key_heads={arch.gdn.num_key_heads} "
            "(GDN layers shard by key-head group)"
        )


# ------------------------------------------------------------------------------------------
# Layer specs (data)
# ------------------------------------------------------------------------------------------


def _attention_spec(sub: Submodules, gated: bool = False) -> Any:
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=(sub.gated_attention or SelfAttention) if gated else SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=sub.linear_qkv,
            core_attention=sub.core_attention,
            linear_proj=sub.linear_proj,
            q_layernorm=sub.qk_norm,
            k_layernorm=sub.qk_norm,
        ),
    )


def _dense_mlp_spec(sub: Submodules) -> Any:
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(
            linear_fc1=sub.linear_fc1, activation_func=sub.activation, linear_fc2=sub.linear_fc2
        ),
    )


def _moe_spec(sub: Submodules, shared_gated: bool = False) -> Any:
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = ModuleSpec(
        module=sub.experts,
        submodules=MLPSubmodules(
            linear_fc1=sub.expert_linear_fc1,
            activation_func=sub.activation,
            linear_fc2=sub.expert_linear_fc2,
        ),
    )
    shared = None
    if shared_gated:
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        shared = ModuleSpec(
            module=sub.shared_experts or SharedExpertMLP,
            submodules=MLPSubmodules(
                linear_fc1=sub.linear_fc1,
                activation_func=sub.activation,
                linear_fc2=sub.linear_fc2,
            ),
        )
    return ModuleSpec(
        module=sub.moe_layer or MoELayer,
        submodules=MoESubmodules(experts=experts, shared_experts=shared, router=sub.router),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def qwen3_layer_spec(arch: ModelArch, layer: int, sub: Submodules) -> Any:
    """Pre-norm decoder layer: RMSNorm → GQA attention with qk-norm + RoPE → RMSNorm → MLP/MoE."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mlp = _moe_spec(sub) if arch.moe_layers[layer] else _dense_mlp_spec(sub)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=sub.norm,
            self_attention=_attention_spec(sub),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=sub.norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _native_gdn_spec(sub: Submodules) -> Any:
    """Megatron's `GatedDeltaNet` as Qwen3-Next / Qwen3.5 run it: q/k l2norm, no biases, conv
    without bias, silu (config) conv activation and output gate. Its output norm is built with
    `zero_centered_gamma=False`: HF's gated norm has a plain gain, while the config's
    `layernorm_zero_centered_gamma` (for every other norm) would make it `x·(1 + w)`, and
    converting the weight by ±1 is not a bit-exact round trip."""
    from megatron.core.ssm import gated_delta_net
    from megatron.core.transformer.spec_utils import ModuleSpec

    assert sub.linear_attention is not None and sub.gated_norm is not None
    if not gated_delta_net.HAVE_FLA:
        raise ImportError(
            "Megatron's GatedDeltaNet needs flash-linear-attention (GPU) or, on a CPU, "
            "transformers (cpu_shims binds its torch l2norm in fla's place)"
        )
    return ModuleSpec(
        module=sub.linear_attention,
        params={"bias": False, "conv_bias": False, "use_qk_l2norm": True},
        submodules=gated_delta_net.GatedDeltaNetSubmodules(
            in_proj=sub.linear_fc1,  # column-parallel, [q | k | v | z | b | a] (flat)
            out_norm=ModuleSpec(module=sub.gated_norm, params={"zero_centered_gamma": False}),
            out_proj=sub.linear_fc2,
        ),
    )


def _is_megatron_gdn(cls: type | None) -> bool:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    return isinstance(cls, type) and issubclass(cls, GatedDeltaNet)


def _gdn_spec(arch: ModelArch, sub: Submodules) -> Any:
    from isoexec.megatron.canonical_gdn import GDNSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    assert sub.linear_attention is not None and sub.gated_norm is not None
    assert arch.gdn is not None
    if _is_megatron_gdn(sub.linear_attention):
        return _native_gdn_spec(sub)
    return ModuleSpec(
        module=sub.linear_attention,
        params={"qkvz_layout": arch.gdn.layout},
        submodules=GDNSubmodules(
            in_proj_qkvz=sub.linear_fc1,  # column-parallel, fused output as HF stores it
            in_proj_ba=sub.linear_fc1,
            norm=sub.gated_norm,
            out_proj=sub.linear_fc2,
        ),
    )


def qwen3_next_layer_spec(arch: ModelArch, layer: int, sub: Submodules) -> Any:
    """GDN-hybrid decoder layer (Qwen3-Next, Qwen3.5 text): zero-centred RMSNorm → GDN
    (linear_attention) or gated attention with partial RoPE → zero-centred RMSNorm → MoE with
    gated shared expert (Qwen3-Next sparse layers) / dense MLP.

    Zero-centred norms come from `layernorm_zero_centered_gamma`, the GDN projection layout
    from `arch.gdn.layout`, the rest from the slots.
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    if sub.linear_attention is None or sub.gated_norm is None or sub.gated_attention is None:
        raise NotImplementedError(
            f"{sub.name} modules have no GDN / gated-attention layer for {arch.architecture}"
        )
    if arch.kinds[layer] == "linear_attention":
        mixer = _gdn_spec(arch, sub)
    else:
        mixer = _attention_spec(sub, gated=True)
    if arch.moe_layers[layer]:
        assert arch.moe is not None
        mlp = _moe_spec(sub, shared_gated=arch.moe.shared_expert_intermediate_size > 0)
    else:
        mlp = _dense_mlp_spec(sub)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=sub.norm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=sub.norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


LayerSpecBuilder = Callable[[ModelArch, int, Submodules], Any]

_LAYER_SPEC_BUILDERS: dict[str, LayerSpecBuilder] = {
    "Qwen3ForCausalLM": qwen3_layer_spec,
    "Qwen3MoeForCausalLM": qwen3_layer_spec,
    "Qwen3NextForCausalLM": qwen3_next_layer_spec,
    "Qwen3_5ForCausalLM": qwen3_next_layer_spec,
    "Qwen3_5MoeForCausalLM": qwen3_next_layer_spec,
    "Qwen3_5ForConditionalGeneration": qwen3_next_layer_spec,
    "Qwen3_5MoeForConditionalGeneration": qwen3_next_layer_spec,
}


def block_spec(arch: ModelArch, sub: Submodules | None = None) -> Any:
    """`TransformerBlockSubmodules` with one layer spec per HF layer, plus the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    sub = sub if sub is not None else native_submodules()
    builder = _LAYER_SPEC_BUILDERS.get(arch.architecture)
    if builder is None:
        raise ValueError(
            f"unsupported architecture {arch.architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return TransformerBlockSubmodules(
        layer_specs=[builder(arch, i, sub) for i in range(arch.num_layers)],
        layer_norm=sub.norm,
    )


# ------------------------------------------------------------------------------------------


def _norms_to_model_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give the norm weights the model dtype, as HF has them.

    Why: `WrappedTorchNorm` builds `torch.nn.RMSNorm` without `params_dtype`, so in a bf16 model
    its weights stay fp32 and promote the normalised activations to fp32, a different
    computation from HF's (and a different export dtype). Any other parameter off `dtype` is a
    bug in the spec and is refused, except a parameter marked `isoexec_keep_fp32` (GDN's
    `A_log`, fp32 on the engine too).
    """
    for name, p in model.named_parameters():
        if p.dtype == dtype or getattr(p, "isoexec_keep_fp32", False):
            continue
        if name.endswith("norm.weight") and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
        else:
            raise RuntimeError(f"parameter {name} is {p.dtype}, model dtype is {dtype}")


def build_model(
    hf_config: HFConfigSource | ModelArch,
    *,
    isoexec: bool = False,
    tp: int = 1,
    dtype: torch.dtype = torch.float32,
    options: IsoExecOptions | None = None,
    initialize: bool = True,
) -> Any:
    """A Megatron-core `GPTModel` with the HF model's architecture (weights: see `weights`).

    `initialize=False` skips the random initialisation (Megatron's `perform_initialization`):
    for a model whose weights are loaded next (`load_hf_weights` refuses a checkpoint that does
    not cover every parameter), which at 35B widths saves most of the build time on a CPU.

    Must be called inside an initialised parallel state (`megatron_parallel()`), whose TP size
    must equal `tp`. `isoexec=True` installs the canonical submodules in every slot and then
    reads every op site back: a site left native is an error (`SiteNotInstalledError`), never
    a silent fallback.

    `options` (`IsoExecOptions`, the object the engine takes too) chooses canonical variants:
    `tp_invariant=True` runs the row-parallel sites (o_proj, down_proj) as the TP-invariant
    `linear_tp` (K in `DEFAULT_TP_LEAVES` fixed leaves, fixed tree): logprobs are then bitwise
    the same at TP=1, 2, 4, 8 — but they are a different contract from the default
    `linear` (an engine must run `linear_tp` at those sites too). isoexec with TP>1 needs it.
    GDN hybrids at TP>1: isoexec only (their GDN layers shard by key-head group, the shared
    expert stays whole on every rank); native GDN layers are TP=1 only.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    arch = hf_config if isinstance(hf_config, ModelArch) else load_hf_config(hf_config)
    if isoexec:
        sub = isoexec_submodules()
    else:
        sub = native_submodules()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("build_model needs Megatron parallel_state: use megatron_parallel()")
    if ps.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(
            f"tp={tp} but parallel_state has TP={ps.get_tensor_model_parallel_world_size()}"
        )
    options = options or IsoExecOptions()
    tp_invariant = options.tp_invariant
    if options != IsoExecOptions() and not isoexec:
        raise ValueError("IsoExec options choose canonical variants: they need isoexec=True")
    if isoexec and tp != 1 and not tp_invariant:
        raise ValueError(
            f"build_model(isoexec=True, tp={tp}): a K-split row-parallel linear is not "
            "TP-invariant; pass options=IsoExecOptions(tp_invariant=True) (bitwise equal to "
            "tp=1 with the same options)"
        )
    if tp != 1 and arch.gdn is not None and not isoexec:
        raise NotImplementedError(
            f"build_model(isoexec=False, tp={tp}) for {arch.architecture}: native (stock "
            "Megatron GatedDeltaNet) GDN layers are TP=1 only (the per-rank layout of its fused "
            "in_proj/conv1d is not mapped for weight load/export); isoexec=True with "
            "IsoExecOptions(tp_invariant=True) runs GDN hybrids at TP>1"
        )
    if ps.get_pipeline_model_parallel_world_size() > 1 and arch.tie_word_embeddings:
        raise NotImplementedError(
            f"build_model: {arch.architecture} ties its embeddings; at PP>1 the first and last "
            "stage would each hold a copy whose gradients must be summed per unit in a fixed "
            "order, which is not wired: run tied models at PP=1"
        )
    if not torch.cuda.is_available():
        from isoexec.megatron.cpu_shims import apply_cpu_shims

        apply_cpu_shims()  # idempotent; re-covers Megatron modules imported since

    spec = block_spec(arch, sub)  # first: refuses what these modules cannot build
    from isoexec.contract.ops.gemm import DEFAULT_TP_LEAVES
    from isoexec.megatron.pipeline import current_stage

    leaves = DEFAULT_TP_LEAVES if tp_invariant else None
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    config = transformer_config(
        arch, tp=tp, dtype=dtype, sub=sub, tp_leaves=leaves, backend=options.backend, pp=pp,
        ep=ep if arch.is_moe else 1, initialize=initialize, logprobs_mode=options.logprobs_mode,
    )  # fmt: skip
    stage = current_stage(config)
    spec.layer_specs = spec.layer_specs[stage.first_layer : stage.first_layer + stage.num_layers]
    model_cls = sub.model or GPTModel
    model = model_cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=stage.pre_process,
        post_process=stage.post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="none" if sub.rope_in_core_attention else "rope",
        rotary_percent=arch.partial_rotary_factor,  # unused with RoPE in the core attention
        rotary_base=arch.rope_theta,
    )
    _norms_to_model_dtype(model, dtype)
    model.isoexec_arch = arch  # the facts it was built from, for weights/scoring/contract
    model.isoexec_mode = isoexec
    model.isoexec_stage = stage  # the layers it holds (all of them at PP=1)
    if isoexec:
        from isoexec.megatron.contract_readback import verify_installed

        verify_installed(model)
    return model


__all__ = [
    "Submodules",
    "block_spec",
    "build_model",
    "isoexec_submodules",
    "native_submodules",
    "qwen3_layer_spec",
    "qwen3_next_layer_spec",
    "transformer_config",
]
