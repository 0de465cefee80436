"""Qwen3-Next for vLLM with IsoExec's gated attention: a registered model class.

vLLM's `Qwen3NextAttention` is a plain `nn.Module` (not a `CustomOp` or `PluggableLayer`) that
applies its output gate inline (`attn_output * torch.sigmoid(gate)`), so no layer registration
reaches it. Its projections, q/k norms, RoPE and attention are registered layers, canonical
already; only the gate is not. IsoExec therefore serves the architecture with its own model
class, through vLLM's model extension point (`ModelRegistry.register_model`, done with the
weight gate: `weight_gate.GATED_ARCHITECTURES`): vLLM's construction as it is, then each gated
attention it built becomes an `IsoQwen3NextAttention` (the gate bound to the canonical op),
before any weight is loaded or any graph compiled. Nothing in vLLM's modules is rebound.
"""

from __future__ import annotations

from typing import Any

from isoexec.vllm.gdn import IsoQwen3NextAttention
from vllm.model_executor.models.qwen3_next import Qwen3NextAttention, Qwen3NextForCausalLM


class IsoQwen3NextForCausalLM(Qwen3NextForCausalLM):
    """vLLM's Qwen3-Next whose full-attention layers run the canonical output gate."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        adopted = [
            IsoQwen3NextAttention.adopt(m) for m in self.modules() if type(m) is Qwen3NextAttention
        ]
        if not adopted and any(t == "full_attention" for t in self.config.layer_types):
            raise RuntimeError("Qwen3-Next: no gated attention layer found to make canonical")


__all__ = ["IsoQwen3NextForCausalLM"]
