"""Canonical truncated sampling: top-k, top-p and min-p as one kept set per row, the same on
both sides.

Why: the engine's own truncation is not something the trainer can reproduce. vLLM's top-k keeps
every token tied with the k-th, its top-p sums probabilities in whatever order its kernel
(Triton, FlashInfer, a PyTorch sort) picks, and its min-p is a separate logits processor. A
token kept on one side and dropped on the other changes the renormalised logprob of every
sampled token, or makes it -inf. So both sides compute the kept set with this one function.

The rule (docs/ops.md, "Truncated sampling"), per row of logits x over a vocab of V:
1. Order the tokens by fp32 logit, descending, ties broken by the lower token id. That is a
   total order: any correct sort gives the same permutation.
2. Every rule keeps a prefix of that order, so the kept set is the first n tokens. The rules
   run in vLLM's order: min-p, then top-k, then top-p over what is left.
   - min-p: s_i = x_i / T (fp32 true division); keep s_i - s_0 >= fp32(ln(min_p)). That is
     p_i >= min_p * p_max, decided in logit space (no softmax needed).
   - top-k: the first k (0 < k < V; anything else keeps all).
   - top-p: e_i = exp(s_i - s_0) (the canonical position-invariant exp) over the prefix left,
     c = its running sum in fp64, in that order; keep i while c_{i-1} < p * c_last: the
     shortest prefix whose mass reaches p. The top token is always kept.
3. The settings are fp32 numbers, as vLLM stores them, on both sides.

The processed logprob is the log-softmax over the kept set (the others -inf): renormalised
over the kept tokens, what vLLM's processed_logprobs means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _pointwise as pw

RULE = "sorted-prefix-v1"  # the kept-set rule above; the logprobs site records it


class TruncationError(ValueError):
    """Truncation settings outside their domain."""


@dataclass(frozen=True)
class Truncation:
    """One request's truncation settings, in vLLM's spelling: top_k 0 or -1 is off, top_p 1.0
    is off, min_p 0.0 is off. Validated on construction."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise TruncationError(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise TruncationError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise TruncationError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def rows(self, n: int, device: torch.device | str) -> RowTruncation:
        """These settings for each of n rows."""
        k = self.top_k if self.top_k > 0 else 0
        return RowTruncation(
            top_k=torch.full((n,), k, dtype=torch.int64, device=device),
            top_p=torch.full((n,), self.top_p, dtype=torch.float32, device=device),
            min_p=torch.full((n,), self.min_p, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class RowTruncation:
    """Per-row settings of a batch (the engine's batch mixes requests). A None field is off
    for every row; top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 are off for that row."""

    top_k: torch.Tensor | None = None  # integer [B]
    top_p: torch.Tensor | None = None  # fp32 [B]
    min_p: torch.Tensor | None = None  # fp32 [B]

    def active_rows(self, vocab: int) -> torch.Tensor | None:
        """Bool [B]: rows with any rule on (None: no row has one)."""
        on = None
        for field, off in (("top_k", None), ("top_p", 1.0), ("min_p", 0.0)):
            v = getattr(self, field)
            if v is None:
                continue
            row = (v > 0) & (v < vocab) if off is None else (v < off if off else v > off)
            on = row if on is None else on | row
        return on


def _kept_lengths(s: torch.Tensor, t: RowTruncation, vocab: int) -> torch.Tensor:
    """n per row from sorted tempered values s [B, M] (non-increasing along each row): the
    whole sorted row (M = V), or its first M >= n_k entries when every row has a top-k."""
    b, m = s.shape
    n = torch.full((b,), vocab, dtype=torch.int64, device=s.device)
    head = s[:, :1]
    if t.min_p is not None:
        mp = t.min_p.to(torch.float32).to(torch.float64)
        # fp32(ln(min_p)) from fp64, so the threshold does not depend on a device's fp32 log
        thr = torch.where(mp > 0, torch.log(mp.clamp_min(1e-300)), -math.inf).to(torch.float32)
        counted = ((s - head) >= thr[:, None]).sum(-1)
        n = torch.minimum(n, torch.where(counted < m, counted, vocab))  # all M: maybe more
    if t.top_k is not None:
        k = t.top_k.to(torch.int64)
        n = torch.minimum(n, torch.where((k > 0) & (k < vocab), k, vocab))
    if m < vocab and bool((n > m).any()):
        raise RuntimeError("a candidate prefix shorter than a row's kept set (a bug)")
    if t.top_p is not None:
        p = t.top_p.to(torch.float32).to(torch.float64)
        rank = torch.arange(m, device=s.device)
        inside = rank[None, :] < n[:, None]
        e = torch.where(inside, pw.exp(s - head), 0.0).to(torch.float64)
        c = torch.cumsum(e, dim=-1)
        before = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=-1)
        total = c[:, -1:]
        count = ((before < p[:, None] * total) & inside).sum(-1)
        n = torch.where(p < 1.0, torch.minimum(n, count), n)
    return n.clamp_min(1)


def _sorted_prefix(x: torch.Tensor, width: int | None) -> torch.Tensor:
    """Token ids of each row [B, V] in the canonical order (value descending, lower id first
    among ties): all V of them, or (`width`) the first W >= width. The prefix comes from a
    top-`width` selection — which picks among ties arbitrarily, so every token tied with the
    width-th value is added — re-sorted in id order by a stable sort: the same ids, in the
    same order, as the first W of the full sort (at a real vocabulary, ~100x less work)."""
    v = x.shape[-1]
    if width is None or width >= v:
        return torch.sort(x, dim=-1, descending=True, stable=True).indices
    kth = torch.topk(x, width, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    w = int((x >= kth).sum(-1).max())  # every token at least the width-th value
    if w >= v:
        return torch.sort(x, dim=-1, descending=True, stable=True).indices
    ids = torch.topk(x, w, dim=-1, sorted=False).indices.sort(-1).values  # in id order
    order = torch.sort(x.gather(-1, ids), dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order)


def truncation_mask(
    logits: torch.Tensor, temperature: torch.Tensor, truncation: RowTruncation
) -> torch.Tensor:
    """Bool [B, V]: the tokens each row keeps. `temperature` fp32 [B], the one the row is
    sampled at (greedy rows: 1.0). Rows with no rule on keep everything; each row's result
    depends on that row alone. Rows with a top-k sort only a prefix of their order (the
    kept set lies in the first k); the others sort the whole row."""
    b, v = logits.shape
    keep = torch.ones((b, v), dtype=torch.bool, device=logits.device)
    on = truncation.active_rows(v)
    if on is None or not bool(on.any()):
        return keep
    k = truncation.top_k
    has_k = on & (k > 0) & (k < v) if k is not None else torch.zeros_like(on)
    for group in (has_k, on & ~has_k):
        rows = group.nonzero().reshape(-1)
        if rows.numel() == 0:
            continue
        x = logits[rows].float()
        width = int(k[rows].max()) if group is has_k else None  # type: ignore[index]
        order = _sorted_prefix(x, width)
        temp = temperature.to(torch.float32)[rows]
        s = x.gather(-1, order) / temp[:, None].expand(-1, order.shape[-1])
        sub = RowTruncation(*(None if f is None else f[rows] for f in (
            truncation.top_k, truncation.top_p, truncation.min_p)))  # fmt: skip
        n = _kept_lengths(s, sub, v)
        ranked = torch.arange(order.shape[-1], device=logits.device)[None, :] < n[:, None]
        kept = torch.zeros((rows.numel(), v), dtype=torch.bool, device=logits.device)
        keep[rows] = kept.scatter_(-1, order, ranked)
    return keep


def truncate(
    logits: torch.Tensor, temperature: torch.Tensor, truncation: RowTruncation
) -> torch.Tensor:
    """fp32 logits with every token outside the kept set at -inf (a copy)."""
    keep = truncation_mask(logits, temperature, truncation)
    return logits.float().masked_fill(~keep, -math.inf)


__all__ = ["RULE", "RowTruncation", "Truncation", "TruncationError", "truncate", "truncation_mask"]
