"""The MoE block (Qwen3-MoE, Qwen3-Next) as the canonical router + experts + combine.

vLLM's CPU MoE splits one block over a runner (`MoERunner`: gate, shared experts, all-reduce),
a router (`CPURouter`: top-k on raw logits, then a softmax over the k, tie order unfixed) and
an expert kernel (`CPUUnquantizedExperts`, which pads and repacks the stacked weights). Their
bits depend on the batch, and the shared expert is added after both halves were rounded.
IsoExec replaces the two ends through vLLM's own out-of-tree registration:

- `IsoUnquantizedFusedMoEMethod` (`CustomOp.register_oot`) keeps the checkpoint layout
  `w13 [E, 2I, H] = cat(gate, up)`, `w2 [E, H, I]` (the layout the trainer stacks too) and
  refuses to run under any runner but ours;
- `IsoMoERunner` (`PluggableLayer.register_oot`) runs the whole block as the trainer does:
  `logits = linear(x, W_gate)`, `ops.moe_router`, `ops.moe_combine` (routed experts, shared
  expert with its sigmoid gate, fixed-order fp32 combine, one rounding).

The stock router object still exists (vLLM builds it before the runner) but is never called.
"""

from __future__ import annotations

from typing import Any

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.ops.binding import SiteBinding, SiteOps, bind
from isoexec.ops.gemm import clear_packed_weight_cache
from isoexec.vllm.engine_binding import engine_binding
from isoexec.vllm.layers import UnsupportedSiteError, _with_canonical_linear
from vllm.model_executor.custom_op import CustomOp, PluggableLayer
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)


class IsoUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Unquantized expert weights kept exactly as loaded (no CPU padding or repacking)."""

    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from isoexec.vllm.lora import refuse_lora_on_experts

        refuse_lora_on_experts()  # before vLLM's LoRA manager wraps this layer
        super().__init__(*args, **kwargs)
        self.binding: SiteBinding = engine_binding("moe_combine")
        bind(self, self.binding)

    def maybe_roundup_sizes(
        self,
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: Any,
    ) -> tuple[int, int]:
        return hidden_size, intermediate_size_per_partition  # padding would change the GEMMs

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # bf16/fp16 experts run the linear's blocks on packed expert slices, cached per
        # parameter: vLLM wrote these through `.data`, which the cache cannot see
        clear_packed_weight_cache()

    def apply(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise UnsupportedSiteError(
            f"{getattr(layer, 'layer_name', '?')}: canonical experts run only inside "
            "IsoMoERunner (this MoE layer was built with another runner class)"
        )


def _is_canonical_linear(module: torch.nn.Module | None) -> bool:
    impl = getattr(getattr(module, "quant_method", None), "isoexec_impl", None)
    return impl is not None and impl.op == "linear"


class IsoMoERunner(MoERunner):
    """One MoE block = `linear` (router logits) → `moe_router` → `moe_combine`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check_supported()
        # The runner calls the router's ops and the experts' combine: the router binding is
        # its own, the combine binding its experts' method's (whose record the contract reads).
        router = engine_binding("moe_router")
        router.owner = self
        self._router_impl = router.impl
        self.ops = SiteOps([router, self.routed_experts.quant_method.binding])

    def _check_supported(self) -> None:
        experts, cfg = self.routed_experts, self.moe_config
        problems = []
        if not isinstance(experts.quant_method, IsoUnquantizedFusedMoEMethod):
            problems.append(f"expert method {type(experts.quant_method).__name__} (quantized?)")
        if self.gate is None or not _is_canonical_linear(self.gate):
            problems.append("no canonical router gate held by the runner")
        if cfg.ep_size > 1 or cfg.dp_size > 1 or cfg.pcp_size > 1:
            problems.append("expert/data/context-parallel MoE")
        if cfg.is_sequence_parallel:
            problems.append("sequence-parallel MoE")
        if (
            experts.global_num_experts != experts.local_num_experts
            or experts.expert_map is not None
        ):
            problems.append("expert map / redundant experts")
        if experts.activation != MoEActivation.SILU:
            problems.append(f"activation {experts.activation}")
        if experts.use_grouped_topk or experts.custom_routing_function is not None:
            problems.append("grouped or custom routing")
        if experts.scoring_func != "softmax":
            problems.append(f"scoring {experts.scoring_func!r}")
        if experts.e_score_correction_bias is not None:
            problems.append("score correction bias")
        if experts.routed_scaling_factor != 1.0 or self.routed_scaling_factor != 1.0:
            problems.append("routed scaling factor")
        if experts.apply_router_weight_on_input:
            problems.append("router weight applied on the input")
        if cfg.has_bias or experts.swiglu_limit is not None or experts.swiglu_alpha is not None:
            problems.append("expert bias / clamped SwiGLU")
        if self.routed_input_transform is not None or self.routed_output_transform is not None:
            problems.append("latent (transformed) routed experts")
        if self.shared_expert_gate is not None:
            problems.append("fused shared expert")
        if self._shared_experts is not None:
            mlp = self._shared_experts._layer
            parts = (getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
            if not all(_is_canonical_linear(p) for p in parts):
                problems.append(f"shared expert {type(mlp).__name__} is not canonical")
            gate = getattr(mlp, "expert_gate", None)
            if gate is not None and not _is_canonical_linear(gate):
                problems.append("shared expert gate is not canonical")
        if problems:
            raise UnsupportedSiteError(
                f"MoE {self.layer_name!r}: canonical MoE does not support: " + ", ".join(problems)
            )

    @property
    def isoexec_impls(self) -> dict[str, ImplInfo]:
        """Router and combine, read from what this runner actually holds."""
        method = self.routed_experts.quant_method
        combine = getattr(method, "isoexec_impl", None)
        return {
            "moe_router": self._router_impl,
            "moe_combine": combine or ImplInfo.native("moe_combine", type(method).__name__),
        }

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # `router_logits` is the hidden state itself when the runner holds the gate (always,
        # here); the logits are recomputed with the canonical linear.
        if shared_experts_input is not None and shared_experts_input is not hidden_states:
            raise UnsupportedSiteError("separate shared-expert input is not canonical")
        x = hidden_states
        experts = self.routed_experts
        assert self.gate is not None
        o = self.ops
        logits = o.linear(x, self.gate.weight)
        topk_weights, topk_ids = o.moe_router(
            logits, experts.top_k, renormalize=experts.renormalize
        )
        shared: dict[str, torch.Tensor] = {}
        if self._shared_experts is not None:
            mlp = self._shared_experts._layer
            shared["shared_w13"] = self._whole(mlp.gate_up_proj.weight, -2, gate_up=True)
            shared["shared_w2"] = self._whole(mlp.down_proj.weight, -1)
            if getattr(mlp, "expert_gate", None) is not None:
                shared["shared_gate_w"] = mlp.expert_gate.weight  # replicated
        w13 = self._whole(experts.w13_weight, -2, gate_up=True)
        w2 = self._whole(experts.w2_weight, -1)
        return o.moe_combine(x, topk_weights, topk_ids, w13, w2, **shared)

    def _whole(self, w: torch.Tensor, dim: int, *, gate_up: bool = False) -> torch.Tensor:
        """An expert weight whole: as loaded at TP=1; gathered exactly at TP>1.

        vLLM shards each expert's (and the shared expert's) intermediate dim over TP: w13 /
        gate_up holds this rank's [gate; up] rows, w2 / down_proj its columns, and the stock
        runner all-reduces rounded partial outputs. The canonical combine runs whole experts
        (as the trainer does at every TP), so every rank gathers the shards in rank order and
        computes the full output itself; nothing is all-reduced. The gather runs every forward
        (no cache that a `.data` weight write could leave stale): it costs a transfer of the
        expert weights per MoE layer per step.
        """
        if self.moe_config.tp_size == 1:
            return w
        from vllm.distributed import tensor_model_parallel_all_gather as all_gather

        d = dim % w.dim()
        if not gate_up:
            return all_gather(w.contiguous(), d)
        gate, up = w.chunk(2, dim=d)
        return torch.cat([all_gather(gate.contiguous(), d), all_gather(up.contiguous(), d)], d)


def register_moe() -> None:
    """Register the overrides. Must run before the model is constructed.

    `GateLinear` (the router's logits linear) becomes a canonical linear too: that keeps its
    plain weight (the stock CPU path empties it) and makes its own forward canonical.
    """
    PluggableLayer.register_oot(name="GateLinear")(_with_canonical_linear(GateLinear))
    CustomOp.register_oot(name="UnquantizedFusedMoEMethod")(IsoUnquantizedFusedMoEMethod)
    PluggableLayer.register_oot(name="MoERunner")(IsoMoERunner)
