"""Writes into vLLM's own tables where vLLM 0.32 offers no extension point. One place, each
with its reason, pinned to the vLLM version they were written against.

- `text_only_config_hook`: vLLM picks a per-architecture config hook from
  `vllm.model_executor.models.config.MODELS_CONFIG_MAP`; the table has no registration
  function. Served text only, a Qwen3.5 vision-language architecture needs the hook of its
  causal-LM sibling, which drops the M-RoPE fields so the runner passes 1-D positions.
"""

from __future__ import annotations

WRITTEN_FOR_VLLM = "0.32"

# Vision-language name -> the causal-LM name whose config hook a text-only engine uses.
_TEXT_ONLY_HOOK_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


class VllmVersionError(RuntimeError):
    """vLLM's internals differ from those a patch here was written for."""


def text_only_config_hook(arch: str) -> None:
    """Give `arch` its causal-LM sibling's config hook (a no-op for a causal-LM name)."""
    sibling = _TEXT_ONLY_HOOK_OF.get(arch)
    if sibling is None:
        return
    from vllm.model_executor.models import config as model_configs

    table = model_configs.MODELS_CONFIG_MAP
    if sibling not in table:
        raise VllmVersionError(
            f"vLLM has no config hook for {sibling} (written for vLLM {WRITTEN_FOR_VLLM})"
        )
    table[arch] = table[sibling]


__all__ = ["WRITTEN_FOR_VLLM", "VllmVersionError", "text_only_config_hook"]
