"""Read a Hugging Face model config into the facts the Megatron model must reproduce.

The trainer must build *exactly* the architecture the engine serves, so every config field that
changes the forward pass is either mapped or refused here; nothing is silently dropped. This
module needs no `transformers` (the trainer package does not depend on it): it reads
`config.json`, a mapping, or any object with `to_dict()` (a `PretrainedConfig`).

Supported: `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `Qwen3NextForCausalLM` (GDN hybrid:
linear-attention layers, gated full attention with partial RoPE, zero-centred norms, MoE with a
gated shared expert), `Qwen3_5ForCausalLM` (Qwen3.5 text: the same hybrid with a dense SwiGLU
MLP in every layer and split GDN input projections), `Qwen3_5MoeForCausalLM` (the same with
Qwen3-Next's MoE + gated shared expert), and the released vision-language checkpoints
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`, whose text model is
read from the nested `text_config` (`isoexec.contract.architectures`). A new architecture adds
a parser to `_PARSERS` (and, in `model_builder`, a layer-spec builder).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from isoexec.contract.architectures import (
    UnsupportedModelError,
    architecture_name,
    architecture_of,
    text_config,
)

HFConfigSource = str | os.PathLike[str] | Mapping[str, Any] | Any


class UnsupportedConfigError(ValueError):
    """The HF config uses a feature the Megatron mapping cannot reproduce exactly."""


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a sparse layer (Qwen3-MoE: no shared expert)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    # True: top-k over softmax probs, then renormalise the k (== softmax over the top-k logits).
    # False: softmax over all experts, keep the k probabilities as they are.
    norm_topk_prob: bool
    # Qwen3-Next: one shared expert of this width, its output scaled by sigmoid(x · w_gate).
    shared_expert_intermediate_size: int = 0


# How a GDN layer's input projections are laid out in the checkpoint (vLLM's `qkvz_layout`):
# "interleaved": Qwen3-Next's fused `in_proj_qkvz` per key-head group [q | k | v×r | z×r] and
# `in_proj_ba` per group [b×r | a×r]; "flat": Qwen3.5's separate `in_proj_qkv` ([q | k | v]),
# `in_proj_z`, `in_proj_b`, `in_proj_a`, which both sides GEMM row-concatenated.
GDN_LAYOUTS = ("interleaved", "flat")


@dataclass(frozen=True)
class GDNConfig:
    """Gated DeltaNet (linear attention) layer sizes, the `linear_*` config fields."""

    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    layout: str = "interleaved"


@dataclass(frozen=True)
class ModelArch:
    """Architecture facts of a decoder-only causal LM, normalised across HF config versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (also dense layers of a MoE model)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_dropout: float
    moe: MoEConfig | None = None
    # Per layer: True where the MLP is the sparse MoE block (all False for dense models).
    moe_layers: tuple[bool, ...] = ()
    # Per layer: "attention" or "linear_attention" (GDN); () means all "attention".
    layer_kinds: tuple[str, ...] = ()
    gdn: GDNConfig | None = None
    # Qwen3-Next: RoPE on the first `rotary_dim` dims of each head, norms `x * (1 + w)`,
    # attention output scaled by sigmoid of a second q_proj half.
    partial_rotary_factor: float = 1.0
    zero_centered_norms: bool = False
    attn_output_gate: bool = False
    # Checkpoint names: the text model's weights under this prefix ("model.language_model."
    # in a vision-language checkpoint); tensors under `unused_prefixes` are not the text model.
    text_prefix: str = "model."
    unused_prefixes: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.moe is not None and any(self.moe_layers)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Per layer "attention" / "linear_attention" (all "attention" unless a hybrid)."""
        return self.layer_kinds or ("attention",) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head: `int(head_dim * partial_rotary_factor)`, vLLM's `get_rope`."""
        return int(self.head_dim * self.partial_rotary_factor)


def _read_source(src: HFConfigSource) -> dict[str, Any]:
    if isinstance(src, str | os.PathLike):
        path = Path(src)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no HF config at {path}")
        with path.open() as f:
            return json.load(f)
    if isinstance(src, Mapping):
        return dict(src)
    to_dict = getattr(src, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise TypeError(
        f"expected a checkpoint dir, a config.json path, a mapping or a PretrainedConfig; "
        f"got {type(src).__name__}"
    )


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UnsupportedConfigError(f"HF config lacks required field {key!r}")
    return cfg[key]


# M-RoPE fields Qwen3.5 carries from its multimodal parent. A text model's three position
# components (T, H, W) are equal, so M-RoPE of any section split is 1-D RoPE (vLLM drops
# these fields for `Qwen3_5ForCausalLM` as well).
MROPE_FIELDS = frozenset({"mrope_section", "mrope_interleaved"})


def _rope(
    cfg: Mapping[str, Any], *, allow_partial: bool = False, text_mrope: bool = False
) -> tuple[float, float]:
    """(RoPE base, partial rotary factor) from `rope_parameters` (transformers>=5) or
    `rope_theta`/`rope_scaling`/`partial_rotary_factor` (<5).

    `text_mrope`: the M-RoPE fields are accepted (text-only positions make it 1-D RoPE)."""
    params = cfg.get("rope_parameters")
    top_partial = cfg.get("partial_rotary_factor")
    if params is not None:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedConfigError(f"rope_type {rope_type!r} (only 'default' RoPE)")
        extra = set(params) - {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
        if text_mrope:
            extra -= MROPE_FIELDS
        if extra:
            raise UnsupportedConfigError(f"rope_parameters fields {sorted(extra)}")
        theta = float(params["rope_theta"])
        partial = float(params.get("partial_rotary_factor", top_partial or 1.0))
    else:
        if cfg.get("rope_scaling"):
            raise UnsupportedConfigError(f"rope_scaling {cfg['rope_scaling']!r}")
        theta = float(cfg.get("rope_theta", 10000.0))
        partial = float(top_partial or 1.0)
    if top_partial is not None and float(top_partial) != partial:
        raise UnsupportedConfigError(
            f"partial_rotary_factor {top_partial} disagrees with rope_parameters ({partial})"
        )
    if partial != 1.0 and not allow_partial:
        raise UnsupportedConfigError("partial_rotary_factor != 1")
    if not 0.0 < partial <= 1.0:
        raise UnsupportedConfigError(f"partial_rotary_factor {partial} outside (0, 1]")
    return theta, partial


def _common(
    cfg: Mapping[str, Any], arch: str, *, hybrid: bool = False, text_mrope: bool = False
) -> dict[str, Any]:
    """Fields and refusals shared by the Qwen3 family (GQA, qk-norm, SwiGLU, RMSNorm, RoPE).

    `hybrid` (Qwen3-Next, Qwen3.5): layer_types and partial RoPE are the caller's to parse;
    `text_mrope` (Qwen3.5): see `_rope`."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"hidden_act {cfg['hidden_act']!r} (only silu/SwiGLU)")
    if cfg.get("attention_bias", False):
        # HF puts a bias on q/k/v *and* o_proj; Megatron's add_qkv_bias covers only q/k/v.
        raise UnsupportedConfigError("attention_bias=True")
    if cfg.get("use_sliding_window", False):
        raise UnsupportedConfigError("use_sliding_window=True")
    layer_types = cfg.get("layer_types")
    if not hybrid and layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise UnsupportedConfigError(f"layer_types {sorted(set(layer_types))}")
    rope_theta, _ = _rope(cfg, allow_partial=hybrid, text_mrope=text_mrope)
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = cfg.get("head_dim")
    return {
        "architecture": arch,
        "vocab_size": int(_require(cfg, "vocab_size")),
        "hidden_size": hidden,
        "num_layers": int(_require(cfg, "num_hidden_layers")),
        "num_attention_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(head_dim) if head_dim else hidden // heads,
        "intermediate_size": int(_require(cfg, "intermediate_size")),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 32768)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qk_norm": True,
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
    }


def _parse_qwen3(cfg: Mapping[str, Any], arch: str) -> ModelArch:
    common = _common(cfg, arch)
    return ModelArch(**common, moe=None, moe_layers=(False,) * common["num_layers"])


def _parse_qwen3_moe(cfg: Mapping[str, Any], arch: str) -> ModelArch:
    common = _common(cfg, arch)
    for shared in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(shared):
            raise UnsupportedConfigError(f"{shared}={cfg[shared]} (Qwen3-MoE has no shared expert)")
    moe, moe_layers = _moe(cfg, common["num_layers"], shared=0)
    return ModelArch(**common, moe=moe, moe_layers=moe_layers)


def _moe(
    cfg: Mapping[str, Any], n: int, *, shared: int
) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """(MoE config or None, per-layer sparse flags): transformers' decoder-layer rule."""
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        raise UnsupportedConfigError("MoE config lacks num_experts / num_local_experts")
    num_experts = int(num_experts)
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedConfigError(f"decoder_sparse_step={step}")
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    if not mlp_only <= set(range(n)):
        raise UnsupportedConfigError(f"mlp_only_layers {sorted(mlp_only)} outside 0..{n - 1}")
    # Exactly transformers' Qwen3MoeDecoderLayer rule.
    moe_layers = tuple(
        (i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(n)
    )
    top_k = int(_require(cfg, "num_experts_per_tok"))
    if num_experts > 0 and not 1 <= top_k <= num_experts:
        raise UnsupportedConfigError(f"num_experts_per_tok={top_k} with {num_experts} experts")
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(_require(cfg, "moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
    )
    return (moe if any(moe_layers) else None), moe_layers


def _hybrid(
    cfg: Mapping[str, Any], n: int, *, layout: str, text_mrope: bool = False
) -> dict[str, Any]:
    """The GDN-hybrid fields (Qwen3-Next, Qwen3.5): layer kinds, GDN sizes, partial RoPE,
    zero-centred norms, gated attention; refuses the variants vLLM could build but the
    canonical layers do not express."""
    _, partial = _rope(cfg, allow_partial=True, text_mrope=text_mrope)
    types = cfg.get("layer_types")
    if not types or len(types) != n:
        raise UnsupportedConfigError(f"layer_types must name all {n} layers, got {types!r}")
    kinds = []
    for t in types:
        if t not in ("full_attention", "linear_attention"):
            raise UnsupportedConfigError(f"layer type {t!r}")
        kinds.append("attention" if t == "full_attention" else "linear_attention")
    if not cfg.get("attn_output_gate", True):
        raise UnsupportedConfigError("attn_output_gate=False")
    if cfg.get("layer_scale", False):
        raise UnsupportedConfigError("layer_scale=True")
    if cfg.get("output_gate_type", "silu") not in ("silu", "swish"):
        raise UnsupportedConfigError(f"output_gate_type {cfg['output_gate_type']!r}")
    gdn = GDNConfig(
        conv_kernel=int(_require(cfg, "linear_conv_kernel_dim")),
        num_key_heads=int(_require(cfg, "linear_num_key_heads")),
        num_value_heads=int(_require(cfg, "linear_num_value_heads")),
        key_head_dim=int(_require(cfg, "linear_key_head_dim")),
        value_head_dim=int(_require(cfg, "linear_value_head_dim")),
        layout=layout,
    )
    if gdn.num_value_heads % gdn.num_key_heads:
        raise UnsupportedConfigError("linear_num_value_heads not a multiple of key heads")
    return {
        "layer_kinds": tuple(kinds),
        "gdn": gdn if "linear_attention" in kinds else None,
        "partial_rotary_factor": partial,
        "zero_centered_norms": True,
        "attn_output_gate": True,
    }


def _parse_qwen3_next(cfg: Mapping[str, Any], arch: str) -> ModelArch:
    """Qwen3-Next: GDN + gated-attention hybrid, zero-centred norms, MoE + gated shared expert.

    Mirrors what vLLM's `Qwen3NextForCausalLM` builds; every variant it could also build but
    IsoExec's canonical layers do not express is refused here.
    """
    common = _common(cfg, arch, hybrid=True)
    n = common["num_layers"]
    hybrid = _hybrid(cfg, n, layout="interleaved")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared <= 0:
        raise UnsupportedConfigError("Qwen3-Next without a shared expert")
    moe, moe_layers = _moe(cfg, n, shared=shared)
    return ModelArch(**common, moe=moe, moe_layers=moe_layers, **hybrid)


def _refuse_moe_fields(cfg: Mapping[str, Any]) -> None:
    for moe_field in ("num_experts", "num_local_experts", "shared_expert_intermediate_size"):
        if cfg.get(moe_field):
            raise UnsupportedConfigError(
                f"{moe_field}={cfg[moe_field]} (Qwen3.5 text has a dense MLP; "
                "Qwen3.5-MoE is another architecture)"
            )


def _parse_qwen3_5_text(cfg: Mapping[str, Any], arch: str) -> ModelArch:
    """Qwen3.5 text (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`): Qwen3-Next's hybrid with
    a dense SwiGLU MLP in every layer and split GDN projections ("flat" layout).

    As transformers' `modeling_qwen3_5` (checked there, not assumed): GDN layers with conv
    activation `hidden_act`, `RMSNormGated` output norm (plain gamma), zero-centred
    `Qwen3_5RMSNorm` everywhere else (q/k norm included), q_proj per head [q_h | gate_h] with
    output `attn * sigmoid(gate)`, partial neox RoPE whose M-RoPE sections are moot for text.
    """
    common = _common(cfg, arch, hybrid=True, text_mrope=True)
    n = common["num_layers"]
    hybrid = _hybrid(cfg, n, layout="flat", text_mrope=True)
    _refuse_moe_fields(cfg)
    return ModelArch(**common, moe=None, moe_layers=(False,) * n, **hybrid)


def _parse_qwen3_5_moe_text(cfg: Mapping[str, Any], arch: str) -> ModelArch:
    """Qwen3.5-MoE text (`Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`): the Qwen3.5
    hybrid with Qwen3-Next's sparse block in every layer (router, routed experts, one shared
    expert scaled by sigmoid(x · w_gate)).

    As transformers' `modeling_qwen3_5_moe`: the router always renormalises its top-k
    (`Qwen3_5MoeTopKRouter` has no switch; vLLM reads a missing `norm_topk_prob` as True), so
    an explicit `norm_topk_prob: false` is refused. There is no dense MLP: the config has no
    `intermediate_size`, which the Megatron model takes from the expert width.
    """
    cfg = {
        **cfg,
        "intermediate_size": cfg.get("intermediate_size") or cfg.get("moe_intermediate_size"),
    }
    common = _common(cfg, arch, hybrid=True, text_mrope=True)
    n = common["num_layers"]
    hybrid = _hybrid(cfg, n, layout="flat", text_mrope=True)
    if cfg.get("norm_topk_prob") is False:
        raise UnsupportedConfigError("norm_topk_prob=False (Qwen3.5-MoE always renormalises)")
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise UnsupportedConfigError("dense layers in Qwen3.5-MoE (every layer is sparse)")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared <= 0:
        raise UnsupportedConfigError("Qwen3.5-MoE without a shared expert")
    moe, moe_layers = _moe({**cfg, "norm_topk_prob": True}, n, shared=shared)
    return ModelArch(**common, moe=moe, moe_layers=moe_layers, **hybrid)


_PARSERS: dict[str, Callable[[Mapping[str, Any], str], ModelArch]] = {
    "Qwen3ForCausalLM": _parse_qwen3,
    "Qwen3MoeForCausalLM": _parse_qwen3_moe,
    "Qwen3NextForCausalLM": _parse_qwen3_next,
    "Qwen3_5ForCausalLM": _parse_qwen3_5_text,
    "Qwen3_5MoeForCausalLM": _parse_qwen3_5_moe_text,
    "Qwen3_5ForConditionalGeneration": _parse_qwen3_5_text,
    "Qwen3_5MoeForConditionalGeneration": _parse_qwen3_5_moe_text,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_PARSERS))


def load_hf_config(src: HFConfigSource) -> ModelArch:
    """Parse an HF config (dir, config.json, mapping or PretrainedConfig) into a `ModelArch`.

    Raises ValueError naming the architecture and the supported list for an unknown one, and
    `UnsupportedConfigError` (a ValueError) for a supported one using a feature we cannot build.
    """
    cfg = _read_source(src)
    arch = architecture_name(cfg)  # refuses an unknown or ambiguous one, naming the supported
    parser = _PARSERS[arch]  # every architecture in the table has a parser (tested)
    try:
        layout = architecture_of(cfg)
        parsed = parser(text_config(cfg), arch)
    except (UnsupportedConfigError, UnsupportedModelError) as e:
        raise UnsupportedConfigError(f"{arch}: {e}") from None
    return replace(parsed, text_prefix=layout.text_prefix, unused_prefixes=layout.unused_prefixes)


__all__ = [
    "GDN_LAYOUTS",
    "SUPPORTED_ARCHITECTURES",
    "GDNConfig",
    "HFConfigSource",
    "MoEConfig",
    "ModelArch",
    "UnsupportedConfigError",
    "load_hf_config",
]
