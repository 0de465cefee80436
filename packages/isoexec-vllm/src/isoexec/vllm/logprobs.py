"""The sampler whose returned logprobs are the canonical `logprobs` op.

By default IsoExec returns the logprobs of the distribution actually sampled from (vLLM's
`processed_logprobs`: logits / temperature, fp32 log-softmax over the full vocab), which is
what a PPO ratio needs; the trainer scores with the same op and the same temperature. vLLM's
`raw_logprobs` (T=1 whatever the temperature) is the other mode it supports; the logprobs
site records which one the engine was started with (`mode`), as the trainer's records the one
it scores, so the handshake refuses a mix. vLLM's `*_logits` modes are not logprobs: refused.

Top-k, top-p and min-p are IsoExec's canonical truncation (`isoexec.ops.truncation`), not
vLLM's: the sampler masks the logits to the canonical kept set, then lets vLLM draw from them
with its own truncation switched off (vLLM's top-k keeps ties, its top-p sums in a kernel's
order, its min-p is a logits processor: none of them is what the trainer computes). The
returned logprobs are renormalised over the kept set, as the trainer scores them.

Before temperature, the allowed-token mask, the logit bias and the repetition, frequency and
presence penalties are IsoExec's canonical adjustments (`isoexec.ops.penalties`), in vLLM's
order, in place of vLLM's own mask, bias processor and penalty kernel; the trainer applies the
same function to the same history.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import torch

from isoexec import ops
from isoexec.contract.impl import ImplInfo
from isoexec.contract.options import LOGPROBS_MODES
from isoexec.contract.protocol import SAMPLING_EPS
from isoexec.ops.binding import bind
from isoexec.ops.penalties import RowAdjustments, batch_history
from isoexec.ops.truncation import RowTruncation
from isoexec.vllm.engine_binding import engine_binding, engine_options
from isoexec.vllm.layers import UnsupportedSiteError
from isoexec.vllm.patches import V2_RUNNER_ENV, rebind_sampler
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)
from vllm.v1.sample.sampler import Sampler

LOGPROBS_MODE = "processed_logprobs"  # vLLM's default for IsoExec engines (harness, serve)
# A logprobs mode for which vLLM's `Sampler.sample` and top-k/top-p sampler compute nothing
# (they compute for the processed_* modes only).
_NO_LOGPROBS = "raw_logprobs"


def canonical_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor | None, backend_ops: ModuleType = ops
) -> torch.Tensor:
    """Full fp32 log-softmax rows, each at its request's temperature (greedy rows: T=1)."""
    if temperature is None:
        return backend_ops.log_softmax(logits)
    temps = torch.where(temperature < SAMPLING_EPS, 1.0, temperature).float().cpu()
    groups = torch.unique(temps).tolist()
    if len(groups) == 1:  # every row at one temperature: one call, no row copies
        return backend_ops.log_softmax(logits, temperature=groups[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for t in groups:
        rows = (temps == t).nonzero().reshape(-1).to(logits.device)
        out[rows] = backend_ops.log_softmax(logits[rows], temperature=t)
    return out


def _effective_temperature(
    temperature: torch.Tensor | None, rows: int, device: Any
) -> torch.Tensor:
    """fp32 [B]: each row's sampling temperature, 1.0 for greedy rows (and all-greedy)."""
    if temperature is None:
        return torch.ones(rows, dtype=torch.float32, device=device)
    return torch.where(temperature < SAMPLING_EPS, 1.0, temperature).float()


def request_truncation(sampling_metadata: Any) -> tuple[RowTruncation | None, Any]:
    """This batch's per-row truncation settings, and the metadata vLLM samples with once the
    logits carry them (its own top-k, top-p and min-p switched off). None: no row truncates."""
    min_p = [p for p in sampling_metadata.logitsprocs.argmax_invariant
             if isinstance(p, MinPLogitsProcessor)]  # fmt: skip
    min_p_rows = min_p[0].min_p.reshape(-1) if min_p and min_p[0].min_p_count else None
    if sampling_metadata.top_k is None and sampling_metadata.top_p is None and min_p_rows is None:
        return None, sampling_metadata
    others = [p for p in sampling_metadata.logitsprocs.all if p not in min_p]
    vllm_md = dataclasses.replace(
        sampling_metadata, top_k=None, top_p=None, logitsprocs=LogitsProcessors(others)
    )
    rows = RowTruncation(sampling_metadata.top_k, sampling_metadata.top_p, min_p_rows)
    return rows, vllm_md


def request_adjustments(
    sampling_metadata: Any,
    vocab: int,
    device: Any,
    rows: torch.Tensor | None = None,
    outputs: list[list[int]] | None = None,
) -> RowAdjustments | None:
    """The per-row logit adjustments of logits rows (None: no row has one), read from what
    vLLM gathered for its own: the allowed-token mask, its logit-bias processor's per-request
    biases, the penalties and the prompt and output tokens. `rows`: the request of each row
    (default: row i is request i); `outputs`: each row's tokens generated so far (default:
    the requests' own; under speculation, a draft row's also counts the drafts before it)."""
    md = sampling_metadata
    req = list(range(len(md.output_token_ids))) if rows is None else rows.tolist()
    bias = None
    procs = [p for p in md.logitsprocs.non_argmax_invariant
             if isinstance(p, LogitBiasLogitsProcessor) and p.biases]  # fmt: skip
    if procs:
        biases = procs[0].biases
        pairs = [(i, t, b) for i, r in enumerate(req) for t, b in sorted(biases.get(r, {}).items())]
        if pairs:
            r_ids, ids, values = zip(*pairs, strict=True)
            bias = (
                torch.tensor(r_ids, dtype=torch.int64, device=device),
                torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(values, dtype=torch.float32, device=device),
            )
    index = None if rows is None else rows.to(device)
    banned = md.allowed_token_ids_mask
    if banned is not None and index is not None:
        banned = banned[index]
    if md.no_penalties:
        if banned is None and bias is None:
            return None
        return RowAdjustments(banned=banned, bias=bias)
    prompts = md.prompt_token_ids if index is None else md.prompt_token_ids[index]
    history = md.output_token_ids if outputs is None else outputs
    seen, counts = batch_history(prompts, history, vocab)
    pens = [md.repetition_penalties, md.frequency_penalties, md.presence_penalties]
    if index is not None:
        pens = [p[index] for p in pens]
    return RowAdjustments(banned, bias, seen, counts, *pens)


_BUILT: IsoSampler | None = None


def built_sampler() -> IsoSampler:
    """The sampler this worker's model runner built (the contract's logprobs site)."""
    if _BUILT is None:
        raise UnsupportedSiteError(
            "no IsoExec sampler was built in this worker process (vLLM's Model Runner V2, "
            "its default on CUDA, builds its own sampler; IsoExec's is the V1 runner's: leave "
            f"{V2_RUNNER_ENV} unset or 0, and no watermark / HiSparse config, which force V2)"
        )
    return _BUILT


class IsoSampler(Sampler):
    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise UnsupportedSiteError(
                f"IsoExec returns logprobs ({', '.join(LOGPROBS_MODES)}); the engine was "
                f"started with logprobs_mode={self.logprobs_mode!r}"
            )
        wanted = engine_options().logprobs_mode
        if self.logprobs_mode != wanted:
            raise UnsupportedSiteError(
                f"the engine was started with logprobs_mode={self.logprobs_mode!r} but its "
                f"IsoExec options say {wanted!r}: set both (the trainer takes the options)"
            )
        bind(self, engine_binding("logprobs", mode=self.logprobs_mode))
        # vLLM's own processed logprobs would be computed and thrown away (`sample` returns
        # the canonical ones): its top-k/top-p sampler is told not to compute them. Set on the
        # built sampler, not by building one for another mode: its constructor picks the
        # sampling kernel by mode (on CUDA, FlashInfer only outside the processed modes).
        self.topk_topp_sampler.logprobs_mode = _NO_LOGPROBS
        global _BUILT
        _BUILT = self  # the runner builds one per worker process, before the model loads

    def compute_logprobs(self, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Raw (T=1) logprobs, used by vLLM for prompt logprobs (through `self.sampler`)."""
        return self.ops.log_softmax(logits)

    def apply_logits_processors(  # type: ignore[override]
        self, logits: torch.Tensor, sampling_metadata: Any, predict_bonus_token: bool
    ) -> torch.Tensor:
        """vLLM's steps before sampling, with the canonical adjustments in place of its
        allowed-token mask, logit-bias processor and penalties. What IsoExec cannot reproduce
        is refused at admission; reaching here with it is a bug, refused again."""
        md = sampling_metadata
        if predict_bonus_token or md.bad_words_token_ids:
            raise UnsupportedSiteError(
                "a bonus-token call from vLLM's own rejection sampler (IsoExec's calls `sample` "
                "on canonical rows: `spec_decode`), or bad_words (admission refuses it)"
            )
        holder = md.thinking_budget_state_holder
        if holder is not None and holder.has_tracked_requests():
            raise UnsupportedSiteError("a thinking-token budget is not canonical")
        for proc in md.logitsprocs.non_argmax_invariant:
            if not isinstance(proc, LogitBiasLogitsProcessor):
                logits = proc.apply(logits)  # vLLM's min-tokens (admission: never active)
        adjust = request_adjustments(md, logits.shape[-1], logits.device)
        return logits if adjust is None else self.ops.adjust_logits(logits, adjust)

    def sample(
        self,
        logits: torch.Tensor,
        sampling_metadata: Any,
        logprobs_mode_override: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if logprobs_mode_override not in (None, self.logprobs_mode):
            raise UnsupportedSiteError(f"logprobs mode override {logprobs_mode_override!r}")
        wanted = sampling_metadata.max_num_logprobs is not None or bool(
            sampling_metadata.logprob_token_ids
        )
        raw = self.logprobs_mode == "raw_logprobs"
        temps = None if raw else sampling_metadata.temperature
        # Raw logprobs are those of the logits before any truncation (and T=1).
        processed = canonical_logprobs(logits, None, self.ops) if wanted and raw else None
        truncation, vllm_md = request_truncation(sampling_metadata)
        if truncation is not None:
            rows, device = logits.shape[0], logits.device
            t = _effective_temperature(sampling_metadata.temperature, rows, device)
            keep = self.ops.truncation_mask(logits, t, truncation)
            logits.masked_fill_(~keep, float("-inf"))  # vLLM draws from the kept set only
        # Before vLLM's sampling, which divides the logits by the temperature in place.
        if wanted and not raw:
            processed = canonical_logprobs(logits, temps, self.ops)
        # (the override keeps vLLM's greedy branch from computing logprobs of its own)
        sampled, _ = super().sample(logits, vllm_md, _NO_LOGPROBS)
        return sampled, processed


def install_sampler() -> None:
    """Make vLLM's model runner build `IsoSampler`.

    vLLM has no extension point for the sampler, so this rebinds the one name the model
    runner constructs it through (`vllm.v1.worker.gpu_model_runner.Sampler`, also the base
    of the CPU runner). It runs in the worker process before the runner exists.
    """
    rebind_sampler(IsoSampler)  # and the V1 runner on CUDA (V2 builds its own sampler)
