"""Pipeline parallelism for the trainer: which layers a stage holds, and running a forward (or a
forward + backward) through Megatron's own pipeline schedule.

A pipeline stage computes exactly what the same layers compute at PP=1: the hidden state sent
to the next stage is the tensor itself (a gloo p2p copy), so logprobs and gradients are
bitwise those of PP=1 by construction, and the stages together declare the PP=1 contract.

Scoring and `train_step` (`isoexec.megatron.scoring`) call `run_schedule` once per unit (one
packed micro-batch): the schedule is Megatron's (`get_forward_backward_func`, 1F1B at PP>1),
with one micro-batch per call so that each unit's gradient can be taken whole into the
trainer's fixed-order gradient tree, as at PP=1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a pipeline: its rank, the pipeline size, and its global layers."""

    rank: int
    size: int
    first_layer: int
    num_layers: int

    @property
    def pre_process(self) -> bool:
        """This stage embeds the tokens."""
        return self.rank == 0

    @property
    def post_process(self) -> bool:
        """This stage holds the final norm, the output layer and the logprobs."""
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        """The global (HF) indices of the layers this stage holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)


def current_stage(config: Any) -> PipelineStage:
    """This process's stage under Megatron's parallel_state and layer split for `config`."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    rank = ps.get_pipeline_model_parallel_rank()
    size = ps.get_pipeline_model_parallel_world_size()
    return PipelineStage(
        rank=rank,
        size=size,
        first_layer=get_transformer_layer_offset(config, None, rank),
        num_layers=get_num_layers_to_build(config, None, rank),
    )


def model_stage(model: torch.nn.Module) -> PipelineStage:
    """The stage a model from `build_model` holds (the whole model at PP=1)."""
    stage = getattr(model, "isoexec_stage", None)
    if isinstance(stage, PipelineStage):
        return stage
    arch = getattr(model, "isoexec_arch", None)
    if arch is None:
        raise TypeError("model was not built by isoexec.megatron.build_model (no isoexec_arch)")
    return PipelineStage(rank=0, size=1, first_layer=0, num_layers=arch.num_layers)


def stage_owns_site(stage: PipelineStage, site: str) -> bool:
    """True when `site` (a contract site name) runs on this stage."""
    if site.startswith("layers."):
        return int(site.split(".", 2)[1]) in stage.layers
    return stage.post_process  # final_norm, lm_head, logprobs


def gather_over_pipeline(obj: Any) -> list[Any]:
    """Every stage's `obj`, in stage order (just `[obj]` at PP=1)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(out, obj, group=ps.get_pipeline_model_parallel_group())
    return out


def broadcast_from_last_stage(obj: Any) -> Any:
    """The last stage's `obj` on every stage (identity at PP=1)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    return gather_over_pipeline(obj)[-1]


def run_schedule(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    seq_length: int,
    last_stage_fn: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
    *,
    forward_only: bool,
) -> Any:
    """One micro-batch through Megatron's pipeline schedule; the last stage's result.

    `inputs` are `model(**inputs)`'s arguments for a [1, seq_length] packed batch (every stage
    passes them: the first stage embeds the ids, every stage needs the positions and packing).
    On the last stage `last_stage_fn(logits)` returns (loss, data); with `forward_only=False`
    the schedule backpropagates the loss through every stage, gradients accumulating into
    `.grad`. Returns `data` on the last stage, None elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Any, mdl: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        output = mdl(**batch)

        def loss_func(output_tensor: torch.Tensor, non_loss_data: bool = False) -> Any:
            loss, data = last_stage_fn(output_tensor)
            return data if non_loss_data else (loss, data)

        return output, loss_func

    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([inputs]),
        model=[model],
        num_microbatches=1,
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )
    return store[0] if store else None


__all__ = [
    "PipelineStage",
    "broadcast_from_last_stage",
    "current_stage",
    "gather_over_pipeline",
    "model_stage",
    "run_schedule",
    "stage_owns_site",
]
