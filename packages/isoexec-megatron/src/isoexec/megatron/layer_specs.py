"""The layer specs of the Megatron model, as data: `Submodules` (which class fills every slot of
a layer: linears, norms, core attention, activation, MoE layer, router, experts, and the model
class; Megatron's own or IsoExec's canonical ones) and one `LayerSpecBuilder` per architecture,
turned into a `TransformerBlockSubmodules` by `block_spec`. `model_builder` has the why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from isoexec.megatron.hf_config import SUPPORTED_ARCHITECTURES, ModelArch


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
    from isoexec.megatron import canonical_modules as cm
    from isoexec.megatron import gdn

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
    from isoexec.megatron.gdn import GDNSubmodules
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
