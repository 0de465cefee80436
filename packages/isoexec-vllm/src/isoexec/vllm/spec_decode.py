"""Speculative decoding that keeps the bits: the rejection sampler whose target rows are the
canonical processed rows (`isoexec.vllm.logprobs`).

Why it can: the verification forward runs the target model over the k draft tokens and the
bonus position as one chunk, and IsoExec's ops give a row the same bits whether it is computed
in a chunk, a prefill or a decode step. What remains is the sampling arithmetic, which vLLM's
`RejectionSampler` does with its own code (`apply_sampling_constraints`: its temperature, its
top-k/top-p kernels; its penalties over the drafts). `IsoRejectionSampler` keeps vLLM's
acceptance rule (`rejection_sample`, unchanged: which token is kept is a draw, not a logprob)
and replaces the rows it decides on and returns logprobs of: each row gets the canonical
adjustments from its own history (the output so far plus the drafts before it), the canonical
kept set and the canonical temperature, exactly as the sampler does at a decode step. So the
logprob returned for an accepted, recovered or bonus token is the one the trainer computes
for that token at that position.

The draft (n-gram here) only proposes tokens; its bits do not reach a returned logprob.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from isoexec.ops.truncation import RowTruncation
from isoexec.vllm.layers import UnsupportedSiteError
from isoexec.vllm.logprobs import (
    IsoSampler,
    _effective_temperature,
    request_adjustments,
    request_truncation,
)
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor import LogitsProcessors, build_logitsprocs
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.rejection_sampler import RejectionSampler, rejection_sample


def _row_layout(
    metadata: Any, outputs: list[list[int]], num_rows: int
) -> tuple[list[int], list[list[int]]]:
    """The request of each logits row and each row's tokens generated so far, placed by vLLM's
    own indices: request r's i-th draft row (`target_logits_indices`) has seen its output and
    drafts[:i], its bonus row (`bonus_logits_indices`) all k_r drafts. (vLLM's warm-up run
    passes dummy indices; rows it does not name keep request 0 and no history.)"""
    drafts = metadata.draft_token_ids.tolist()
    targets = metadata.target_logits_indices.tolist()
    bonus = metadata.bonus_logits_indices.tolist()
    req = [0] * num_rows
    hist: list[list[int]] = [[] for _ in range(num_rows)]
    start = 0
    for r, k in enumerate(metadata.num_draft_tokens):
        d = drafts[start : start + k]
        out = outputs[r] if r < len(outputs) else []
        for i, row in enumerate(targets[start : start + k]):
            req[row], hist[row] = r, [*out, *d[:i]]
        req[bonus[r]], hist[bonus[r]] = r, [*out, *d]
        start += k
    return req, hist


class IsoRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler over canonical processed rows (see the module docstring)."""

    def __init__(self, sampler: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(sampler, IsoSampler):  # refused as the engine is built
            raise UnsupportedSiteError("IsoExec's rejection sampler needs IsoExec's sampler")
        super().__init__(sampler, *args, **kwargs)
        # The verifier the runner built, found through its sampler by the worker's contract
        # (a served worker reads it back from the sampler alone: `engine_contract`).
        sampler.isoexec_rejection_sampler = self

    def forward(  # type: ignore[override]
        self,
        metadata: Any,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sampling_metadata: Any,
    ) -> SamplerOutput:
        sampler = self.sampler
        md = sampling_metadata
        if md.bad_words_token_ids:
            raise UnsupportedSiteError("bad_words is not canonical (admission refuses it)")
        req, hist = _row_layout(metadata, md.output_token_ids, logits.shape[0])
        rows = torch.tensor(req, dtype=torch.int64, device=logits.device)
        x = logits.float()
        adjust = request_adjustments(md, logits.shape[-1], logits.device, rows, hist)
        if adjust is not None:
            x = sampler.ops.adjust_logits(x, adjust)
        # The bonus token: the sampler's own draw from the canonical kept set.
        quiet = dataclasses.replace(md, max_num_logprobs=None, logprob_token_ids=None)
        bonus, _ = sampler.sample(x[metadata.bonus_logits_indices].clone(), quiet)
        bonus_ids = bonus.to(torch.int32).unsqueeze(-1)
        # Every row's processed logits: the canonical kept set, then the canonical temperature.
        batch = len(metadata.num_draft_tokens)
        temps = _effective_temperature(md.temperature, batch, logits.device)[rows]
        truncation, _ = request_truncation(md)
        if truncation is not None:
            fields = (truncation.top_k, truncation.top_p, truncation.min_p)
            per_row = RowTruncation(*(None if f is None else f[rows] for f in fields))
            keep = sampler.ops.truncation_mask(x, temps, per_row)
            x = x.masked_fill(~keep, float("-inf"))
        processed = x / temps[:, None].expand_as(x)  # fp32 true division, as `_tempered`
        target = metadata.target_logits_indices
        output = rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            draft_probs,
            processed[target].clone(),
            bonus_ids,
            md,
            synthetic_mode=self.synthetic_mode,
            synthetic_conditional_rates=self.synthetic_conditional_rates,
            use_fp64_gumbel=self.use_fp64_gumbel,
        )
        logprobs = None
        if md.max_num_logprobs is not None:
            # The processed rows (admission refuses speculation in raw_logprobs mode): the
            # sampler's `compute_logprobs` is the canonical log-softmax, at T=1 of these.
            logprobs = self._get_logprobs_tensors(
                md.max_num_logprobs,
                metadata,
                logits,
                processed[target],
                processed[metadata.bonus_logits_indices],
                output,
            )
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)


def build_logitsprocs_under_speculation(
    vllm_config: Any,
    device: torch.device,
    is_pin_memory: bool,
    is_pooling_model: bool,
    custom_logitsprocs: Sequence[Any] = (),
) -> Any:
    """vLLM's `build_logitsprocs`, except for a speculating engine whose only custom
    processor is IsoExec's admission check: vLLM refuses every custom processor there (its
    rejection sampler cannot apply them to draft rows). The admission check changes no logits,
    so this builds what vLLM builds under speculation (min-tokens only: its frontend refuses
    min-p and logit bias with speculation) and the admission check."""
    from isoexec.vllm.engine_kwargs import ADMISSION

    if (
        vllm_config.speculative_config
        and not is_pooling_model
        and [_qualname(p) for p in custom_logitsprocs] == [ADMISSION]
    ):
        from isoexec.vllm.admission import IsoAdmission

        procs = [MinTokensLogitsProcessor, IsoAdmission]
        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in procs)
    return build_logitsprocs(
        vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs
    )


def _qualname(proc: Any) -> str:
    return proc if isinstance(proc, str) else f"{proc.__module__}:{proc.__qualname__}"


def install_rejection_sampler() -> None:
    """Make vLLM's model runner build `IsoRejectionSampler` and, under speculation, IsoExec's
    admission check (module-global rebindings in `vllm.v1.worker.gpu_model_runner`, as the
    sampler's)."""
    from isoexec.vllm.patches import rebind_rejection_sampler

    rebind_rejection_sampler(IsoRejectionSampler, build_logitsprocs_under_speculation)


__all__ = [
    "IsoRejectionSampler",
    "build_logitsprocs_under_speculation",
    "install_rejection_sampler",
]
