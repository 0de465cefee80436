"""Framework-neutral op sites: the names both sides use for the places where an op runs.

The site list of a model is derived from its Hugging Face config alone, so trainer and engine
agree on it without talking; each side maps its own module names onto these names and must
cover every one (a missing site is an installation error, never a silent omission).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from isoexec.contract.architectures import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    architecture_name,
    architecture_of,
    text_config,
)


@dataclass(frozen=True)
class Site:
    name: str  # e.g. "layers.3.self_attn.core"
    op: str  # e.g. "attention"


def architecture(hf_config: Mapping[str, Any]) -> str:
    """The config's architecture (one of `SUPPORTED_ARCHITECTURES`), refused otherwise."""
    return architecture_name(hf_config)


def layer_kinds(hf_config: Mapping[str, Any]) -> list[str]:
    """Per layer: 'attention' or 'linear_attention' (GDN), from the HF config."""
    text = text_config(hf_config)
    n = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if not architecture_of(hf_config).hybrid:
        return ["attention"] * n
    if not types or len(types) != n:
        raise UnsupportedModelError("a GDN hybrid config needs layer_types for every layer")
    kinds = []
    for t in types:
        if t == "full_attention":
            kinds.append("attention")
        elif t == "linear_attention":
            kinds.append("linear_attention")
        else:
            raise UnsupportedModelError(f"layer type {t!r} is not supported")
    return kinds


def mlp_kinds(hf_config: Mapping[str, Any]) -> list[str]:
    """Per layer: 'dense', 'moe' or 'moe_shared' (MoE with a gated shared expert).

    Qwen3.5 text (`Qwen3_5ForCausalLM`) has a dense SwiGLU MLP in every layer."""
    kind = architecture_of(hf_config).mlp
    text = text_config(hf_config)
    n = int(text["num_hidden_layers"])
    if kind == "dense":
        return ["dense"] * n
    step = int(text.get("decoder_sparse_step", 1))
    mlp_only = set(text.get("mlp_only_layers") or [])
    experts = num_experts(hf_config)
    return [
        kind if i not in mlp_only and experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(n)
    ]


def num_experts(hf_config: Mapping[str, Any]) -> int:
    """transformers 5 writes `num_local_experts` for Qwen3-MoE, older ones `num_experts`."""
    text = text_config(hf_config)
    for key in ("num_experts", "num_local_experts"):
        if text.get(key) is not None:
            return int(text[key])
    return 0


def model_sites(hf_config: Mapping[str, Any]) -> list[Site]:
    """Every op site of the model, in execution order."""
    sites: list[Site] = []
    add = sites.append
    for i, (kind, mlp) in enumerate(zip(layer_kinds(hf_config), mlp_kinds(hf_config), strict=True)):
        p = f"layers.{i}"
        add(Site(f"{p}.input_norm", "rms_norm"))
        if kind == "attention":
            a = f"{p}.self_attn"
            add(Site(f"{a}.qkv_proj", "linear"))
            add(Site(f"{a}.q_norm", "rms_norm"))
            add(Site(f"{a}.k_norm", "rms_norm"))
            add(Site(f"{a}.rope", "rope"))
            add(Site(f"{a}.core", "attention"))
            add(Site(f"{a}.o_proj", "linear"))
        else:
            g = f"{p}.linear_attn"
            # Qwen3.5 stores in_proj_qkv/in_proj_z and in_proj_b/in_proj_a separately; both
            # sides run each pair as one GEMM on the row-concatenated weight ([qkv; z], [b; a]),
            # so the site is the fused projection, as for Qwen3-Next's fused checkpoint tensors.
            add(Site(f"{g}.in_proj_qkvz", "linear"))
            add(Site(f"{g}.in_proj_ba", "linear"))
            add(Site(f"{g}.conv", "gdn_conv"))
            add(Site(f"{g}.recurrence", "gdn_recurrence"))
            add(Site(f"{g}.norm", "gated_rms_norm"))
            add(Site(f"{g}.out_proj", "linear"))
        add(Site(f"{p}.post_attention_norm", "rms_norm"))
        m = f"{p}.mlp"
        if mlp == "dense":
            add(Site(f"{m}.gate_up_proj", "linear"))
            add(Site(f"{m}.act", "silu_mul"))
            add(Site(f"{m}.down_proj", "linear"))
        else:
            add(Site(f"{m}.router", "moe_router"))
            add(Site(f"{m}.experts", "moe_combine"))
    add(Site("final_norm", "rms_norm"))
    add(Site("lm_head", "linear"))
    add(Site("logprobs", "logprobs"))
    return sites


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Site",
    "UnsupportedModelError",
    "architecture",
    "layer_kinds",
    "mlp_kinds",
    "model_sites",
    "num_experts",
]
