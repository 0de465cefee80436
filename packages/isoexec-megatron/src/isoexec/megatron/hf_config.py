"""Read a Hugging Face model config into the facts the Megatron model must reproduce.

The trainer must build *exactly* the architecture the engine serves, so every config field that
changes the forward pass is either mapped or refused here; nothing is silently dropped. This
module needs no `transformers` (the trainer package does not depend on it): it reads
`config.json`, a mapping, or any object with `to_dict()` (a `PretrainedConfig`).

Supported: `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`. A new architecture adds a parser to
`_PARSERS` (and, in `model_builder`, a layer-spec builder); Qwen3-Next (GDN hybrid) is the next
one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    @property
    def is_moe(self) -> bool:
        return self.moe is not None and any(self.moe_layers)


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


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(
            f"HF config must name exactly one architecture in 'architectures', got {archs!r}; "
            f"supported: {sorted(_PARSERS)}"
        )
    return str(archs[0])


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UnsupportedConfigError(f"HF config lacks required field {key!r}")
    return cfg[key]


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    """RoPE base from `rope_parameters` (transformers>=5) or `rope_theta`/`rope_scaling` (<5)."""
    params = cfg.get("rope_parameters")
    if params is not None:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedConfigError(f"rope_type {rope_type!r} (only 'default' RoPE)")
        extra = set(params) - {"rope_theta", "rope_type", "type"}
        if extra:
            raise UnsupportedConfigError(f"rope_parameters fields {sorted(extra)}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedConfigError("partial_rotary_factor != 1")
        return float(params["rope_theta"])
    if cfg.get("rope_scaling"):
        raise UnsupportedConfigError(f"rope_scaling {cfg['rope_scaling']!r}")
    return float(cfg.get("rope_theta", 10000.0))


def _common(cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """Fields and refusals shared by the Qwen3 family (GQA, qk-norm, SwiGLU, RMSNorm, RoPE)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"hidden_act {cfg['hidden_act']!r} (only silu/SwiGLU)")
    if cfg.get("attention_bias", False):
        # HF puts a bias on q/k/v *and* o_proj; Megatron's add_qkv_bias covers only q/k/v.
        raise UnsupportedConfigError("attention_bias=True")
    if cfg.get("use_sliding_window", False):
        raise UnsupportedConfigError("use_sliding_window=True")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise UnsupportedConfigError(f"layer_types {sorted(set(layer_types))}")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1")
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
        "rope_theta": _rope_theta(cfg),
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
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        raise UnsupportedConfigError("Qwen3-MoE config lacks num_experts / num_local_experts")
    for shared in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(shared):
            raise UnsupportedConfigError(f"{shared}={cfg[shared]} (Qwen3-MoE has no shared expert)")
    num_experts = int(num_experts)
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedConfigError(f"decoder_sparse_step={step}")
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    n = common["num_layers"]
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
    )
    return ModelArch(**common, moe=moe if any(moe_layers) else None, moe_layers=moe_layers)


_PARSERS: dict[str, Callable[[Mapping[str, Any], str], ModelArch]] = {
    "Qwen3ForCausalLM": _parse_qwen3,
    "Qwen3MoeForCausalLM": _parse_qwen3_moe,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_PARSERS))


def load_hf_config(src: HFConfigSource) -> ModelArch:
    """Parse an HF config (dir, config.json, mapping or PretrainedConfig) into a `ModelArch`.

    Raises ValueError naming the architecture and the supported list for an unknown one, and
    `UnsupportedConfigError` (a ValueError) for a supported one using a feature we cannot build.
    """
    cfg = _read_source(src)
    arch = _architecture(cfg)
    parser = _PARSERS.get(arch)
    if parser is None:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        return parser(cfg, arch)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{arch}: {e}") from None


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HFConfigSource",
    "MoEConfig",
    "ModelArch",
    "UnsupportedConfigError",
    "load_hf_config",
]
