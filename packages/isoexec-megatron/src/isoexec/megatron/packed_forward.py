"""One packed forward of an isoexec model: per-sequence logprobs with the autograd graph.

Why a module of its own: scoring (`scoring.score`) and every training step
(`unit_gradients`, under `scoring.train_step` and `policy_loss.policy_train_step`) run the
same packed forward, and the step driver sits below scoring, not beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from isoexec.megatron.logprobs import full_vocab, is_isoexec, site_logprobs, vocab_size
from isoexec.megatron.packing import Pack, pack_sequences
from isoexec.megatron.pipeline import broadcast_from_last_stage, model_stage, run_schedule
from isoexec.ops.penalties import Penalties, RowAdjustments, rows_for_sequences
from isoexec.ops.truncation import Truncation


def model_is_moe(model: torch.nn.Module) -> bool:
    arch = getattr(model, "isoexec_arch", None)
    return bool(getattr(arch, "is_moe", False))


def pipelined(model: torch.nn.Module) -> bool:
    return model_stage(model).size > 1


def pack_logprobs(
    model: torch.nn.Module,
    pack: Pack,
    logits: torch.Tensor,
    temperature: float,
    trunc: Truncation | None = None,
    whole_rows: bool = False,
    adjust: RowAdjustments | None = None,
) -> list[torch.Tensor]:
    """Per sequence fp32 [n-1] logprobs (`whole_rows`: [n-1, V] processed rows) from the
    pack's [1, T, vocab(/TP)] logits."""
    rows = full_vocab(model, logits)[0][pack.rows]
    nxt = None if whole_rows else pack.nxt
    lp = site_logprobs(model, rows, nxt, temperature, trunc, adjust)
    return list(lp.split([n - 1 for n in pack.lens]))


def adjustments(
    model: torch.nn.Module,
    seqs: Sequence[torch.Tensor],
    penalties: Penalties | None,
    prompt_lens: Sequence[int] | None,
) -> RowAdjustments | None:
    """The rows' canonical logit adjustments (None: off), built on the model's device."""
    if penalties is None:
        return None
    device = next(model.parameters()).device
    return rows_for_sequences(penalties, seqs, prompt_lens, vocab_size(model), device)


def packed_logprobs(
    model: torch.nn.Module,
    seqs: list[torch.Tensor],
    temperature: float = 1.0,
    *,
    pad_to_multiple: int | None = None,
    truncation: Truncation | None = None,
    whole_rows: bool = False,
    penalties: Penalties | None = None,
    prompt_lens: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """One packed forward of an isoexec model over `seqs`; per sequence fp32 [n-1] logprobs.
    `penalties` (with each sequence's prompt length): the logit adjustments they were sampled
    with (`isoexec.ops.penalties`).

    Keeps the autograd graph (used by `train_step` and `policy_logprobs`). At PP>1 it runs
    through the pipeline schedule, forward only, and returns detached logprobs.
    """
    if not is_isoexec(model):
        raise TypeError("packed_logprobs runs the canonical ops: an isoexec model only")
    pack = pack_sequences(model, seqs, pad_to_multiple)
    adjust = adjustments(model, seqs, penalties, prompt_lens)
    if not pipelined(model):
        logits = model(**pack.inputs)
        return pack_logprobs(model, pack, logits, temperature, truncation, whole_rows, adjust)

    def last(logits: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lps = pack_logprobs(model, pack, logits, temperature, truncation, whole_rows, adjust)
        return logits.sum() * 0, [lp.detach() for lp in lps]

    return broadcast_from_last_stage(
        run_schedule(model, pack.inputs, pack.length, last, forward_only=True)
    )


__all__ = ["adjustments", "model_is_moe", "pack_logprobs", "packed_logprobs", "pipelined"]
