"""Canonical MoE for Megatron (router, experts stacked as the engine holds them, sigmoid-gated
shared expert, one combine): the trainer's side of `isoexec.vllm.moe`."""

from __future__ import annotations

import copy
from typing import Any

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.megatron.canonical_base import (
    CanonicalSiteError,
    _tp_size,
    bind,
    site_binding,
)
from isoexec.megatron.expert_parallel import (
    ExpertBlocks,
    dispatched_expert_outputs,
    slot_inputs,
)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_config import TransformerConfig


# ---- MoE -------------------------------------------------------------------------------------
class IsoTopKRouter(TopKRouter):
    """Router slot: logits = `ops.linear(x, W_router)` in the model dtype (vLLM's gate is a
    plain linear layer), then `ops.moe_router` (fp32 softmax, stable top-k, optional renorm).

    `forward(x [T, H])` returns (weights fp32 [T, k], expert ids [T, k]) for `IsoMoELayer`.
    """

    isoexec_impl: ImplInfo

    def __init__(self, config: TransformerConfig, pg_collection: Any = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        problems = []
        if config.moe_router_score_function != "softmax":
            problems.append(f"score function {config.moe_router_score_function!r}")
        if config.moe_router_enable_expert_bias or self.bias is not None:
            problems.append("router bias")
        if config.moe_router_topk_scaling_factor not in (None, 1.0):
            problems.append("top-k scaling factor")
        if config.moe_router_num_groups or config.moe_router_group_topk:
            problems.append("group-limited routing")
        if config.moe_expert_capacity_factor is not None:
            problems.append("token dropping")
        if config.moe_input_jitter_eps:
            problems.append("input jitter")
        if problems:
            raise CanonicalSiteError("canonical router does not support: " + ", ".join(problems))
        # transformer_config(): moe_router_pre_softmax = not norm_topk_prob.
        self.renormalize = not config.moe_router_pre_softmax
        bind(self, site_binding(config, "moe_router"))

    def forward(self, x: torch.Tensor, padding_mask: Any = None) -> Any:  # type: ignore[override]
        logits = self.ops.linear(x, self.weight)
        return self.ops.moe_router(logits, self.topk, renormalize=self.renormalize)


class IsoSequentialMLP(SequentialMLP):
    """Experts slot: same parameters as `SequentialMLP` (so HF weight names map unchanged),
    computed by `ops.moe_combine` on the experts stacked in the engine's layout."""

    isoexec_impl: ImplInfo

    def __init__(self, num_local_experts: int, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(num_local_experts, config, **kwargs)
        # Expert parallelism: this rank holds experts first_expert .. (Megatron's split).
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        self.first_expert = ep_rank * num_local_experts
        etp = config.expert_tensor_parallel_size
        if etp not in (None, 1):
            raise CanonicalSiteError(
                f"expert tensor parallelism {etp}: experts must be whole on every TP rank "
                "(megatron_parallel() sets expert_tensor_parallel_size=1)"
            )
        bind(self, site_binding(config, "moe_combine"))

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H] = cat(gate, up), w2 [E, H, I]): Megatron's fc1/fc2 rows as is."""
        w13 = torch.stack([e.linear_fc1.weight for e in self.local_experts])
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])
        return w13, w2

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        expert_out: torch.Tensor,
        **shared: torch.Tensor,
    ) -> torch.Tensor:
        """The MoE block's output [T, H]: `ops.moe_combine` of the routed experts' outputs
        `expert_out` [T, k, H] (`block_outputs`, or from the ranks holding the experts) and the
        shared expert (`shared`: `shared_w13`, `shared_w2`, `shared_gate_w`)."""
        unused = x.new_empty(0)  # the experts' weights: their outputs are given
        return self.ops.moe_combine(
            x, topk_weights, topk_ids, unused, unused, expert_out=expert_out, **shared
        )

    def block_outputs(
        self, slots: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """([T, k, H] outputs of this rank's experts, -0.0 in slots routed to other ranks; the
        stacked (w13, w2) they ran against). Each call stacks its own copy of the weights, so
        autograd gives each block of tokens its own expert gradient (`ExpertBlocks`)."""
        w13, w2 = self.stacked_weights()
        y = self.ops.moe_experts(slots, topk_ids, w13, w2, first_expert=self.first_expert)
        return y, (w13, w2)


class IsoSharedExpertMLP(SharedExpertMLP):
    """Shared-expert slot: Megatron's parameters (fc1 = cat(gate, up), fc2, `gate_weight`
    [1, H]), computed inside `ops.moe_combine` by `IsoMoELayer` (the engine adds the shared
    expert inside the same fixed-order fp32 combine); its own forward is never canonical.

    Whole and replicated on every TP rank, like the routed experts at expert TP = 1: its
    linears are built in the expert-TP group (size 1) instead of Megatron's TP group, and their
    `tensor_model_parallel` marks are cleared (the weights load, export and count in grad
    norms as replicated). Gradients need no TP reduction: every rank computes the whole MoE
    layer from the same full input and the same full output gradient.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Any,
        gate: bool,
        pg_collection: Any = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        whole = copy.copy(pg_collection)
        expt_tp = getattr(pg_collection, "expt_tp", None)
        whole.tp = expt_tp if expt_tp is not None else ps.get_expert_tensor_parallel_group()
        if whole.tp.size() != 1:
            raise CanonicalSiteError(
                f"expert tensor parallelism {whole.tp.size()}: the shared expert must be whole "
                "on every TP rank (megatron_parallel() sets expert_tensor_parallel_size=1)"
            )
        super().__init__(config, submodules, gate, pg_collection=whole)
        for linear in (self.linear_fc1, self.linear_fc2):
            for p in linear.parameters():
                p.tensor_model_parallel = False  # type: ignore[attr-defined]
                p.partition_dim = -1  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise CanonicalSiteError("the shared expert runs inside ops.moe_combine (IsoMoELayer)")

    def combine_kwargs(self) -> dict[str, torch.Tensor]:
        """The `shared_*` arguments of `ops.moe_combine`, the engine's layouts as is."""
        out = {"shared_w13": self.linear_fc1.weight, "shared_w2": self.linear_fc2.weight}
        if self.gate_weight is not None:
            out["shared_gate_w"] = self.gate_weight
        return out


class IsoMoELayer(MoELayer):
    """MoE block: route and combine canonically on [T, H], no token dispatcher.

    Every token's result depends only on its own row (canonical linear is row-invariant, the
    combine is a fixed ascending-expert sum), so packing and padding cannot change it. At
    EP>1 the routed experts' per-slot inputs and outputs travel through Megatron's all-gather
    token dispatcher (`expert_parallel`), and the combine stays local and canonical.
    At EP>1 `expert_blocks` holds the stacked expert weights of the last forward under autograd,
    one entry per source rank (`train_step` reads them); at EP=1 nothing is kept.
    """

    expert_blocks: ExpertBlocks

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_shared_expert and not isinstance(self.shared_experts, IsoSharedExpertMLP):
            raise CanonicalSiteError(
                f"shared experts {type(self.shared_experts).__name__}: only IsoSharedExpertMLP "
                "(computed inside ops.moe_combine) is canonical"
            )
        if self.use_shared_expert and self.shared_expert_overlap:
            raise CanonicalSiteError("overlapped shared experts are not canonical")
        shared = self.shared_experts
        if self.use_shared_expert and (
            _tp_size(shared.linear_fc1) != 1 or _tp_size(shared.linear_fc2) != 1
        ):
            raise CanonicalSiteError("a TP-sharded shared expert: ops.moe_combine needs it whole")
        for name, mod in (("router", self.router), ("experts", self.experts)):
            if not hasattr(mod, "isoexec_impl"):
                raise CanonicalSiteError(f"IsoMoELayer needs a canonical {name}, got {mod!r}")

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        if intermediate_tensors is not None:
            raise CanonicalSiteError("partial MoE forward (CUDA-graph pieces) is not canonical")
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, ids = self.router(x)
        # Slots in ascending expert id, the combine's own summation order (same bits), so
        # every rank's slot layout is the one Megatron's routing map gives back.
        ids, order = torch.sort(ids, dim=-1, stable=True)
        weights = weights.gather(-1, order)
        slots = slot_inputs(x, ids.shape[1])
        self.expert_blocks = ExpertBlocks()
        if self.ep_group is None or self.ep_group.size() == 1:
            y, _ = self.experts.block_outputs(slots, ids)  # autograd reaches the parameters
        else:
            y = dispatched_expert_outputs(
                slots, ids, self.experts, self.token_dispatcher, self.expert_blocks
            )
        shared = self.shared_experts.combine_kwargs() if self.use_shared_expert else {}
        out = self.experts(x, weights, ids, expert_out=y, **shared)
        return out.reshape(hidden_states.shape), None
