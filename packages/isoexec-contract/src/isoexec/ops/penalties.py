"""Canonical logit adjustments before temperature: the allowed-token mask, the logit bias and the
repetition, frequency and presence penalties, the same on both sides.

Why: these change the distribution the engine samples from, so its processed logprobs; the
trainer must apply the very same fp32 operations, in the same order, from the same history
(the prompt and the tokens generated before each position) or the ratio is off. vLLM's own
code for them is a CUDA kernel on GPU and a different one on CPU, applied through a logits
processor whose state the trainer never sees. So both sides call `adjust_logits`.

The rule (docs/ops.md, "Penalties and logit bias"), per row, on fp32 logits x, in this order
(vLLM's order, so the meaning of each setting is vLLM's and OpenAI's):
1. allowed_token_ids: every other token is -inf.
2. logit_bias: x_t = x_t + fp32(b_t) for each biased token t (one fp32 add).
3. repetition_penalty r, for every token seen in the prompt or the output so far:
   x_t = x_t / r if x_t > 0 else x_t * r (fp32 true division / product).
4. frequency_penalty f: x_t = x_t - f * c_t, c_t the token's count in the output so far
   (the product rounded to fp32 first, then the subtraction: two roundings, never an FMA).
5. presence_penalty p: x_t = x_t - p * [c_t > 0] (the same two roundings).
Neutral settings (no mask, no bias, r = 1, f = 0, p = 0) give back x bit for bit, so a row
without adjustments is the same whether or not the rule runs on it.

"So far" at the position that samples output token j is the prompt and output tokens 0..j-1:
`sequence_history` builds it for every position of a scored sequence, `batch_history` from the
engine's per-request lists. Both count with integers: exact on any device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

RULE = "mask-bias-rep-freq-pres-v1"  # the rule above; the logprobs site records it


class PenaltiesError(ValueError):
    """Adjustment settings outside their domain."""


def _finite(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v):
        raise PenaltiesError(f"{name} must be a finite number, got {value!r}")
    return v


@dataclass(frozen=True)
class Penalties:
    """One request's logit adjustments, in vLLM's spelling (1.0, 0.0, 0.0, no bias, no
    allow-list: off). `logit_bias` is (token id, bias) pairs sorted by id, `allowed_token_ids`
    sorted ids (None: every token). Validated on construction; hashable (a scoring group key)."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not _finite("repetition_penalty", self.repetition_penalty) > 0.0:
            raise PenaltiesError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _finite("frequency_penalty", self.frequency_penalty)
        _finite("presence_penalty", self.presence_penalty)
        ids = [t for t, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(_bad_id(t) for t in ids):
            raise PenaltiesError(
                f"logit_bias must be (token id >= 0, bias) pairs, each id once, sorted by id: "
                f"{self.logit_bias!r}"
            )
        for t, b in self.logit_bias:
            _finite(f"logit_bias[{t}]", b)
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not allowed or list(allowed) != sorted(set(allowed)) or any(_bad_id(t) for t in allowed)
        ):
            raise PenaltiesError(
                f"allowed_token_ids must be distinct ids >= 0, sorted, at least one: {allowed!r}"
            )

    @classmethod
    def of(
        cls,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
    ) -> Penalties:
        """From vLLM's `SamplingParams` spelling (a bias dict, an id list)."""
        bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
        allowed = None if allowed_token_ids is None else tuple(sorted(set(allowed_token_ids)))
        return cls(float(repetition_penalty), float(frequency_penalty), float(presence_penalty),
                   bias, allowed)  # fmt: skip

    @property
    def active(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
        )

    @property
    def uses_history(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def sampling_params(self) -> dict[str, object]:
        """These settings as `vllm.SamplingParams` keyword arguments."""
        out: dict[str, object] = {
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            out["allowed_token_ids"] = list(self.allowed_token_ids)
        return out

    def check_vocab(self, vocab: int) -> None:
        ids = [t for t, _ in self.logit_bias] + list(self.allowed_token_ids or ())
        if ids and max(ids) >= vocab:
            raise PenaltiesError(f"token id {max(ids)} is outside the vocabulary of {vocab}")


def _bad_id(t: object) -> bool:
    return isinstance(t, bool) or not isinstance(t, int) or t < 0


@dataclass(frozen=True)
class RowAdjustments:
    """A batch's adjustments, per row (None: off for every row). `banned` bool [B, V] (True:
    -inf); `bias` (rows, ids, fp32 values) with each (row, id) once; `seen` bool [B, V] (in the
    prompt or output so far); `counts` integer [B, V] (in the output so far); the penalties
    fp32 [B]."""

    banned: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    seen: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None


def adjust_logits(logits: torch.Tensor, adj: RowAdjustments) -> torch.Tensor:
    """fp32 [B, V] logits after the rule of the module docstring (a new tensor; `logits` is
    left as it is). Each row's result depends on that row alone."""
    x = logits.float().clone()
    if adj.banned is not None:
        x.masked_fill_(adj.banned, float("-inf"))
    if adj.bias is not None:
        rows, ids, values = adj.bias
        x[rows, ids] = x[rows, ids] + values.to(torch.float32)
    if adj.repetition is not None and adj.seen is not None:
        r = adj.repetition.to(torch.float32)[:, None].expand_as(x)
        x = torch.where(adj.seen, torch.where(x > 0, x / r, x * r), x)
    if adj.counts is not None:
        c = adj.counts.to(torch.float32)
        if adj.frequency is not None:
            step = adj.frequency.to(torch.float32)[:, None] * c  # rounded to fp32 here
            x = x - step
        if adj.presence is not None:
            step = adj.presence.to(torch.float32)[:, None] * (c > 0).to(torch.float32)
            x = x - step
    return x


def sequence_history(
    ids: torch.Tensor, prompt_len: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows 0..n-2 of a scored sequence `ids` [n] (row i samples token i+1): `seen`
    bool [n-1, V] (in the prompt ids[:prompt_len], or in ids[prompt_len:i+1]) and `counts`
    int32 [n-1, V] (occurrences in ids[prompt_len:i+1]), what the engine had when it sampled."""
    n = int(ids.numel())
    if not 1 <= prompt_len <= n:
        raise PenaltiesError(f"prompt length {prompt_len} outside 1..{n}")
    rows = n - 1
    dev = ids.device
    steps = torch.zeros((rows, vocab), dtype=torch.int32, device=dev)
    out_rows = torch.arange(prompt_len, rows, device=dev)  # row i adds output token ids[i]
    steps[out_rows, ids[prompt_len:rows].long()] = 1
    counts = torch.cumsum(steps, dim=0, dtype=torch.int32)
    prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
    prompt[ids[:prompt_len].long()] = True
    return prompt[None, :] | (counts > 0), counts


def batch_history(
    prompt_ids: torch.Tensor, outputs: Sequence[Sequence[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`seen` bool [B, V] and `counts` int32 [B, V] of an engine batch: `prompt_ids` [B, L]
    padded with `vocab` (vLLM's padding), `outputs` each request's output tokens so far."""
    b = len(outputs)
    dev = prompt_ids.device
    width = max((len(o) for o in outputs), default=0)
    out = torch.full((b, max(width, 1)), vocab, dtype=torch.int64)
    for i, o in enumerate(outputs):
        out[i, : len(o)] = torch.tensor(list(o), dtype=torch.int64)
    out = out.masked_fill_(out < 0, vocab).to(dev)  # (vLLM's async placeholders are -1)
    counts = torch.zeros((b, vocab + 1), dtype=torch.int32, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
    counts = counts[:, :vocab]
    prompt = torch.zeros((b, vocab + 1), dtype=torch.bool, device=dev)
    prompt.scatter_(1, prompt_ids.long(), True)
    return prompt[:, :vocab] | (counts > 0), counts


def rows_for(penalties: Penalties, n: int, vocab: int, device: torch.device | str,
             history: tuple[torch.Tensor, torch.Tensor] | None) -> RowAdjustments:  # fmt: skip
    """One request's settings for its n rows (`history`: `sequence_history`'s, needed when a
    penalty is on)."""
    penalties.check_vocab(vocab)
    banned = None
    if penalties.allowed_token_ids is not None:
        banned = torch.ones((n, vocab), dtype=torch.bool, device=device)
        banned[:, list(penalties.allowed_token_ids)] = False
    bias = None
    if penalties.logit_bias:
        ids = torch.tensor([t for t, _ in penalties.logit_bias], dtype=torch.int64, device=device)
        vals = torch.tensor([b for _, b in penalties.logit_bias], dtype=torch.float32,
                            device=device)  # fmt: skip
        k = ids.numel()
        bias = (torch.arange(n, device=device).repeat_interleave(k), ids.repeat(n), vals.repeat(n))
    if not penalties.uses_history:
        return RowAdjustments(banned=banned, bias=bias)
    if history is None:
        raise PenaltiesError("penalties need the history (the prompt length of each sequence)")
    seen, counts = history

    def full(v: float) -> torch.Tensor:
        return torch.full((n,), v, dtype=torch.float32, device=device)

    return RowAdjustments(
        banned,
        bias,
        seen,
        counts,
        full(penalties.repetition_penalty),
        full(penalties.frequency_penalty),
        full(penalties.presence_penalty),
    )


def rows_for_sequences(
    penalties: Penalties,
    seqs: Sequence[torch.Tensor],
    prompt_lens: Sequence[int] | None,
    vocab: int,
    device: torch.device | str,
) -> RowAdjustments:
    """The adjustments of the rows of scored sequences `seqs` (each [n], rows 0..n-2 in order,
    concatenated), all sampled with `penalties`; `prompt_lens[i]`: where sequence i's output
    begins (needed when a penalty is on)."""
    rows = sum(int(s.numel()) - 1 for s in seqs)
    history = None
    if penalties.uses_history:
        if prompt_lens is None or len(prompt_lens) != len(seqs):
            raise PenaltiesError(
                "penalties count the tokens generated so far: give each sequence's prompt length "
                f"(prompt_lens), got {prompt_lens!r} for {len(seqs)} sequences"
            )
        parts = [sequence_history(s.to(device), int(p), vocab)
                 for s, p in zip(seqs, prompt_lens, strict=True)]  # fmt: skip
        history = (torch.cat([h[0] for h in parts]), torch.cat([h[1] for h in parts]))
    return rows_for(penalties, rows, vocab, device, history)


__all__ = [
    "RULE",
    "Penalties",
    "PenaltiesError",
    "RowAdjustments",
    "adjust_logits",
    "batch_history",
    "rows_for",
    "rows_for_sequences",
    "sequence_history",
]
