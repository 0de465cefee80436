"""Scoring what an engine sampled, with the record of how it was sampled.

`score(model, sequences, temperature)` trusts its caller's settings; a served engine may have
applied a default the caller never saw (a checkpoint's generation_config.json sets temperature,
top_k, top_p, sometimes a repetition penalty). Here the temperature, truncation, penalties,
logit bias and allow-list come from the completion's own `SamplingRecord`, and a sequence
without one, or one sampled in another logprobs mode than the model scores, is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from isoexec.handshake.served import SamplingRecord, SamplingRecordError
from isoexec.megatron.scoring import score
from isoexec.ops.truncation import Truncation


def score_sampled(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    record: SamplingRecord | None,
    *,
    weights_version: int | None = None,
    prompt_lens: Sequence[int] | None = None,
    **score_kw: Any,
) -> list[torch.Tensor]:
    """`score` with the record's settings; `prompt_lens[i]`: where sequence i's completion
    begins (needed when the record has a penalty, which counts the tokens generated so far).
    Refused without a record, when the
    record's logprobs mode is not the one this model scores, when its adapter is not the one
    attached to the model (`attach_lora(..., name=...)`), or, given `weights_version` (the
    version this model's weights are on the engine: 0 as loaded, +1 per push), when the
    sequences were sampled under another version."""
    if not isinstance(record, SamplingRecord):
        raise SamplingRecordError(
            "refusing to score sequences without the record of what they were sampled with "
            "(SamplingRecord.from_header(response.headers[SAMPLING_HEADER]))"
        )
    if weights_version is not None and record.weights_version != weights_version:
        raise SamplingRecordError(
            f"the sequences were sampled under weights version {record.weights_version}, this "
            f"model holds version {weights_version}: scoring would compare different weights"
        )
    mode = getattr(model, "isoexec_logprobs_mode", "processed_logprobs")
    if record.logprobs_mode != mode:
        raise SamplingRecordError(
            f"the sequences were sampled by an engine returning {record.logprobs_mode}, but "
            f"this model scores {mode}"
        )
    lora = getattr(model, "isoexec_lora", None)  # an attached adapter (`isoexec.megatron.lora`)
    attached = None if lora is None else lora.name
    if record.adapter != attached:
        raise SamplingRecordError(
            f"the sequences were sampled under adapter {record.adapter!r}, but this model has "
            f"{'no adapter' if attached is None else repr(attached)} attached"
        )
    truncation = Truncation(record.top_k, record.top_p, record.min_p)
    return score(model, sequences, temperature=record.temperature, truncation=truncation,
                 penalties=record.penalties(), prompt_lens=prompt_lens, **score_kw)  # fmt: skip


__all__ = ["score_sampled"]
