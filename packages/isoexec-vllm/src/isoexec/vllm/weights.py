"""The engine's live weights under canonical (HF) names, for the weight fingerprint.

vLLM fuses some checkpoint tensors (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`); this
splits them back, so the fingerprint of what the engine *holds* can be compared with the
trainer's export. TP=1 only: a sharded engine must gather first (refused here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class UnsupportedWeightLayoutError(RuntimeError):
    pass


def hf_named_weights(
    model: torch.nn.Module, hf_config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config["num_key_value_heads"])
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    # Qwen3-Next's q_proj holds [q_h | gate_h] per head: twice the query width.
    gated = hf_config.get("model_type") == "qwen3_next" and hf_config.get("attn_output_gate", True)
    q_size, kv_size = heads * head_dim * (2 if gated else 1), kv_heads * head_dim
    for name, param in model.named_parameters():
        t = param.detach()
        if getattr(param, "tp_size", 1) not in (1, None):
            raise UnsupportedWeightLayoutError(f"{name}: sharded (TP>1) weights")
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            q, k, v = t.split([q_size, kv_size, kv_size], dim=0)
            yield base + "q_proj.weight", q
            yield base + "k_proj.weight", k
            yield base + "v_proj.weight", v
        elif name.endswith("gate_up_proj.weight"):  # mlp and shared_expert
            base = name[: -len("gate_up_proj.weight")]
            gate, up = t.chunk(2, dim=0)
            yield base + "gate_proj.weight", gate
            yield base + "up_proj.weight", up
        elif name.endswith("w13_weight"):
            base = _experts_base(name, "w13_weight")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                yield f"{base}{e}.gate_proj.weight", gate
                yield f"{base}{e}.up_proj.weight", up
        elif name.endswith("w2_weight"):
            base = _experts_base(name, "w2_weight")
            for e, w in enumerate(t):
                yield f"{base}{e}.down_proj.weight", w
        else:
            yield name, t


def _experts_base(name: str, suffix: str) -> str:
    """`…mlp.experts[.routed_experts].w13_weight` -> `…mlp.experts.` (HF per-expert names)."""
    base = name[: -len(suffix)]
    base = base.removesuffix("routed_experts.")
    if not base.endswith("mlp.experts."):
        raise UnsupportedWeightLayoutError(f"{name}: unknown expert weight layout")
    return base
