"""The trainer's logprobs site: the op that turns logits into the logprobs the engine also
returns, and what decides its inputs (the vocabulary, the temperature).

The mirror of the engine's `isoexec.vllm.logprobs` (its sampler): both run the canonical
`token_logprobs` / `log_softmax` of `isoexec.ops.logprobs` at the same temperature rule, the
trainer through the model's logprobs binding (`IsoGPTModel.isoexec_ops`). `scoring` packs the
sequences and runs the model; this module is what it calls on the logits.
"""

from __future__ import annotations

import torch

from isoexec import ops
from isoexec.contract.impl import declared_impl
from isoexec.contract.protocol import SAMPLING_EPS
from isoexec.ops.penalties import Penalties, RowAdjustments
from isoexec.ops.truncation import Truncation


def vocab_size(model: torch.nn.Module) -> int:
    vocab = getattr(model, "vocab_size", None)
    if not isinstance(vocab, int):
        raise TypeError("expected a Megatron GPTModel (with .vocab_size)")
    return vocab


def effective_temperature(temperature: float, model: torch.nn.Module | None = None) -> float:
    """The temperature the logprobs are taken at: greedy (below vLLM's epsilon) is T=1, and a
    model scoring `raw_logprobs` (`IsoExecOptions.logprobs_mode`) takes every one at T=1, as
    an engine in that mode returns them."""
    t = float(temperature)
    if not t >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if getattr(model, "isoexec_logprobs_mode", None) == "raw_logprobs":
        return 1.0
    return 1.0 if t < SAMPLING_EPS else t


def effective_truncation(
    truncation: Truncation | None, temperature: float, model: torch.nn.Module | None = None
) -> Truncation | None:
    """The truncation the logprobs are taken under: None when off; None for a greedy request
    (vLLM's `SamplingParams` turns top-k, top-p and min-p off below its temperature epsilon);
    None for a model scoring `raw_logprobs` (such an engine returns the logprobs before
    truncation)."""
    if truncation is not None and not isinstance(truncation, Truncation):
        raise TypeError(
            f"truncation must be an isoexec.ops.truncation.Truncation, not {truncation!r}"
        )
    if truncation is None or not truncation.active or float(temperature) < SAMPLING_EPS:
        return None
    if getattr(model, "isoexec_logprobs_mode", None) == "raw_logprobs":
        return None
    return truncation


def effective_penalties(
    penalties: Penalties | None, model: torch.nn.Module | None = None
) -> Penalties | None:
    """The logit adjustments the logprobs are taken under: None when off, and None for a model
    scoring `raw_logprobs` (such an engine returns the logprobs before them). Unlike
    truncation they apply to greedy requests too, as vLLM applies them."""
    if penalties is not None and not isinstance(penalties, Penalties):
        raise TypeError(f"penalties must be an isoexec.ops.penalties.Penalties, not {penalties!r}")
    if penalties is None or not penalties.active:
        return None
    if getattr(model, "isoexec_logprobs_mode", None) == "raw_logprobs":
        return None
    return penalties


def truncated(
    provider: object,
    logits: torch.Tensor,
    temperature: float,
    truncation: Truncation | None,
    adjust: RowAdjustments | None = None,
) -> torch.Tensor:
    """`logits` after the canonical adjustments (`adjust`, the rows' penalties, bias and mask)
    with the tokens outside each row's canonical kept set at -inf (fp32), as the engine's
    sampler does before it samples and returns logprobs; `logits` unchanged without either.
    `provider`: the ops (a model's site ops, or `isoexec.ops`)."""
    if adjust is not None:
        logits = provider.adjust_logits(logits, adjust)  # type: ignore[attr-defined]
    if truncation is None:
        return logits
    n = logits.shape[0]
    t = torch.full((n,), temperature, dtype=torch.float32, device=logits.device)
    rows = truncation.rows(n, logits.device)
    keep = provider.truncation_mask(logits, t, rows)  # type: ignore[attr-defined]
    return logits.float().masked_fill(~keep, float("-inf"))


def full_rows(
    logits: torch.Tensor,
    temperature: float = 1.0,
    truncation: Truncation | None = None,
    adjust: RowAdjustments | None = None,
) -> torch.Tensor:
    """The whole processed row [n-1, V] of positions 0..n-2 (what the engine returns with
    logprobs=-1): fp32 log_softmax of `logits / T` over each row's kept set (-inf outside)."""
    rows = truncated(ops, logits[:-1], temperature, truncation, adjust)
    return ops.log_softmax(rows, temperature=temperature)


def token_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    truncation: Truncation | None = None,
    adjust: RowAdjustments | None = None,
) -> torch.Tensor:
    """log p(ids[i+1] | ≤ i) from logits [n, vocab] of positions 0..n-1: fp32 log_softmax of
    `logits / T` (after `adjust`, over each row's kept set under `truncation`) + gather.
    Reduces over the contiguous last dim (row-invariant on CPU)."""
    rows = truncated(ops, logits[:-1], temperature, truncation, adjust)
    return ops.token_logprobs(rows, ids[1:], temperature=temperature)


def is_isoexec(model: torch.nn.Module) -> bool:
    """True for a model built with canonical modules (it declares its logprobs op)."""
    declares = declared_impl(model, "logprobs") is not None
    return bool(getattr(model, "isoexec_mode", False)) and declares


def full_vocab(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Logits over the whole vocab. The isoexec output layer gathers them itself; a native
    Megatron model at TP>1 returns this rank's vocab slice (`parallel_output`), gathered here
    (an exact concatenation)."""
    if logits.shape[-1] == vocab_size(model):
        return logits
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits)
    if full.shape[-1] != vocab_size(model):
        raise RuntimeError(f"logits cover {full.shape[-1]} of {vocab_size(model)} vocab ids")
    return full


def site_logprobs(
    model: torch.nn.Module,
    logits: torch.Tensor,
    next_ids: torch.Tensor | None,
    temperature: float,
    truncation: Truncation | None = None,
    adjust: RowAdjustments | None = None,
) -> torch.Tensor:
    """fp32 logprobs of `next_ids` under rows of full-vocab `logits`, through the logprobs
    binding of an IsoExec model (what its contract records for the `logprobs` site); with
    `next_ids` None, the whole processed rows [n, V]."""
    site = model.isoexec_ops  # type: ignore[union-attr]
    rows = truncated(site, logits, temperature, truncation, adjust)
    if next_ids is None:  # the whole rows (full-vocab scoring)
        return site.log_softmax(rows, temperature=temperature)  # type: ignore[operator,no-any-return]
    return site.token_logprobs(rows, next_ids, temperature=temperature)  # type: ignore[operator,no-any-return]


__all__ = [
    "effective_penalties",
    "effective_temperature",
    "effective_truncation",
    "full_rows",
    "full_vocab",
    "is_isoexec",
    "site_logprobs",
    "token_logprobs",
    "truncated",
    "vocab_size",
]
