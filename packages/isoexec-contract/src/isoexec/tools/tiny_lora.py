"""Tiny random LoRA adapters in PEFT's on-disk layout, for tests and the LoRA preset.

An adapter directory as PEFT writes it (`adapter_config.json` + `adapter_model.safetensors`,
tensors named `base_model.model.model.layers.{i}.{module}.lora_{A,B}.weight`), which vLLM's
`LoRARequest` and IsoExec's trainer both load. B is random, not PEFT's zero initialisation: a
zero B adds nothing, and a test with it could not fail.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from isoexec.contract.adapter import PEFT_PREFIX

# PEFT target module -> (its parent in a decoder layer, input width, output width) from the config
_MODULES = {
    "q_proj": ("self_attn", "hidden", "q"),
    "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"),
    "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "ffn"),
    "up_proj": ("mlp", "hidden", "ffn"),
    "down_proj": ("mlp", "ffn", "hidden"),
}
LORA_TARGETS = tuple(_MODULES)


def _widths(cfg: dict[str, Any]) -> dict[str, int]:
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return {
        "hidden": int(cfg["hidden_size"]),
        "q": int(cfg["num_attention_heads"]) * head_dim,
        "kv": int(cfg["num_key_value_heads"]) * head_dim,
        "ffn": int(cfg["intermediate_size"]),
    }


def make_tiny_lora(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random adapter for the dense Qwen3 checkpoint in `model_dir` (every layer,
    `targets` modules). Deterministic for given arguments."""
    import torch
    from safetensors.torch import save_file

    unknown = set(targets) - set(_MODULES)
    if unknown:
        raise ValueError(f"LoRA targets {sorted(unknown)}: known {list(_MODULES)}")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("model_type") != "qwen3":
        raise ValueError(f"make_tiny_lora: dense Qwen3 only, not {cfg.get('model_type')!r}")
    widths = _widths(cfg)
    gen = torch.Generator().manual_seed(seed)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tensors = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for module in targets:
            parent, k_in, k_out = _MODULES[module]
            n_in, n_out = widths[k_in], widths[k_out]
            name = f"{PEFT_PREFIX}.{layer}.{parent}.{module}"
            a = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            b = torch.randn(n_out, rank, generator=gen) / rank**0.5 * 0.5
            tensors[f"{name}.lora_A.weight"] = a.to(tdtype).contiguous()
            tensors[f"{name}.lora_B.weight"] = b.to(tdtype).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


__all__ = ["LORA_TARGETS", "PEFT_PREFIX", "make_tiny_lora"]
