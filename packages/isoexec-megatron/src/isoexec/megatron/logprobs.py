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


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(ids[i+1] | ≤ i) from logits [n, vocab] of positions 0..n-1: fp32 log_softmax of
    `logits / T` + gather. Reduces over the contiguous last dim (row-invariant on CPU)."""
    return ops.token_logprobs(logits[:-1], ids[1:], temperature=temperature)


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
    model: torch.nn.Module, logits: torch.Tensor, next_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """fp32 logprobs of `next_ids` under rows of full-vocab `logits`, through the logprobs
    binding of an IsoExec model (what its contract records for the `logprobs` site)."""
    return model.isoexec_ops.token_logprobs(logits, next_ids, temperature=temperature)  # type: ignore[union-attr,operator,no-any-return]


__all__ = [
    "effective_temperature",
    "full_vocab",
    "is_isoexec",
    "site_logprobs",
    "token_logprobs",
    "vocab_size",
]
