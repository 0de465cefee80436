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
   - top-p: over the prefix A left, e_i = exp(s_i - s_0) (the canonical position-invariant
     exp) in fixed point, q_i = floor(e_i * 2^40) as an integer; keep i while the sum of q
     before i (in the order) is < ceil(p * sum of q over A). Integer sums are exact: no
     summation order, device or reduction tree can change them. The shortest prefix whose
     mass reaches p; the top token is always kept.
3. The settings are fp32 numbers, as vLLM stores them, on both sides.

Only a prefix of the order is ever needed, so rows are not sorted whole: a top-k row sorts
its first k (a top-k selection, every token tied with the k-th added, re-sorted by value then
id); a top-p row a prefix that doubles until the nucleus ends inside it; a min-p row nothing
(its set is a threshold). The same ids in the same order as the whole-row sort (tested).

The processed logprob is the log-softmax over the kept set (the others -inf): renormalised
over the kept tokens, what vLLM's processed_logprobs means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _pointwise as pw

RULE = "sorted-prefix-v2"  # the kept-set rule above; the logprobs site records it
# (v1: the top-p mass as an fp64 running sum in sorted order, which needed the whole sort)
FIXED_POINT_BITS = 40  # q_i = floor(e_i * 2^40): V * 2^40 < 2^63 for any V < 2^23
_FIRST_WIDTH = 1024  # a top-p row's first sorted prefix (doubled until the nucleus ends)


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


def _min_p_threshold(min_p: torch.Tensor) -> torch.Tensor:
    """fp32(ln(min_p)) per row, from fp64 (not a device's fp32 log); -inf where off."""
    mp = min_p.to(torch.float32).to(torch.float64)
    return torch.where(mp > 0, torch.log(mp.clamp_min(1e-300)), -math.inf).to(torch.float32)


def _fixed_point(e: torch.Tensor) -> torch.Tensor:
    """floor(e * 2^40) as int64 for fp32 e in [0, 1] (the scaling by a power of 2 is exact)."""
    return torch.floor(e.double() * float(2**FIXED_POINT_BITS)).to(torch.int64)


def _nucleus_bound(total: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """ceil(p * total) per row, exactly (Python integers and fractions): a position i is in
    the nucleus while its integer mass before it is below this."""
    from fractions import Fraction

    ps = top_p.to(torch.float32).tolist()
    bounds = [-(-Fraction(p) * t // 1) for p, t in zip(ps, total.tolist(), strict=True)]
    return torch.tensor([int(b) for b in bounds], dtype=torch.int64, device=total.device)


def _sorted_prefix(x: torch.Tensor, width: int) -> torch.Tensor:
    """Token ids of each row [B, V] in the canonical order (value descending, lower id first
    among ties): the first W >= width of them (all V when width >= V). A top-`width`
    selection picks among ties arbitrarily, so every token tied with the width-th value is
    added; a stable sort of the selection taken in id order then gives the same ids, in the
    same order, as the first W of the whole-row sort."""
    v = x.shape[-1]
    if width < v:
        kth = torch.topk(x, width, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        w = int((x >= kth).sum(-1).max())  # every token at least the width-th value
        if w < v:
            ids = torch.topk(x, w, dim=-1, sorted=False).indices.sort(-1).values  # id order
            order = torch.sort(x.gather(-1, ids), dim=-1, descending=True, stable=True).indices
            return ids.gather(-1, order)
    return torch.sort(x, dim=-1, descending=True, stable=True).indices


def _nucleus(inside: torch.Tensor, mass: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Per row, the positions of a prefix of the order that are in A (`inside`) and whose
    integer mass (`mass`, in that order) before them is below `bound`."""
    mass = torch.where(inside, mass, 0)
    before = torch.cumsum(mass, dim=-1) - mass  # exact: integers
    return ((before < bound[:, None]) & inside).sum(-1)


def _rows_kept(x: torch.Tensor, temp: torch.Tensor, t: RowTruncation) -> torch.Tensor:
    """Bool [B, V] kept sets of rows that each have a rule on (see the module docstring)."""
    b, v = x.shape
    s = x / temp[:, None].expand(-1, v)  # fp32 true division, elementwise
    head = s.amax(-1, keepdim=True)  # = s_0: the division is monotone
    keep = torch.ones((b, v), dtype=torch.bool, device=x.device)
    if t.min_p is not None:  # a prefix of the order given by a threshold: no sort needed
        keep &= (s - head) >= _min_p_threshold(t.min_p)[:, None]
    p = t.top_p if t.top_p is not None else torch.ones(b, device=x.device)
    p_on = p < 1.0
    zero = torch.zeros(b, dtype=torch.int64, device=x.device)
    tk = t.top_k.to(torch.int64) if t.top_k is not None else zero
    k_on = (tk > 0) & (tk < v)
    out = keep.clone() if t.min_p is not None else keep  # min-p alone: the threshold set
    for rows, with_k in ((k_on.nonzero().reshape(-1), True),
                         (((~k_on) & p_on).nonzero().reshape(-1), False)):  # fmt: skip
        if rows.numel() == 0:
            continue
        every = rows.numel() == b  # (no row copies when the group is the whole batch)
        xr, sr, hr, kr = (x, s, head, keep) if every else (x[rows], s[rows], head[rows], keep[rows])
        pr, pon = p[rows], p_on[rows]
        k = tk[rows] if with_k else torch.full_like(rows, v)
        # Top-k rows: A lies in the first k. The others: A is the min-p set, its mass order-free.
        width = int(k.max()) if with_k else min(v, _FIRST_WIDTH)
        q = None if with_k else _fixed_point(pw.exp(sr - hr))  # each token's mass, exactly
        total = None if q is None else torch.where(kr, q, 0).sum(-1)
        while True:
            order = _sorted_prefix(xr, width)
            w = order.shape[-1]
            rank = torch.arange(w, device=x.device)[None, :]
            inside = kr.gather(-1, order) & (rank < k[:, None])
            size = inside.sum(-1)  # |A ∩ prefix|
            if not bool(pon.any()):
                count = size
                break
            mass = (
                _fixed_point(pw.exp(sr.gather(-1, order) - hr))
                if q is None
                else q.gather(-1, order)
            )
            tot = torch.where(inside, mass, 0).sum(-1) if total is None else total
            count = _nucleus(inside, mass, _nucleus_bound(tot, pr))
            # Settled when A lies in the prefix, or the nucleus ends inside it.
            if with_k or w >= v or bool(((size < w) | (count < size) | ~pon).all()):
                break
            width = min(v, 2 * w)
        n = torch.where(pon, torch.minimum(size, count), size).clamp_min(1)
        kept = torch.zeros_like(kr).scatter_(-1, order, rank < n[:, None])
        if every:
            return kept
        out[rows] = kept
    return out


def truncation_mask(
    logits: torch.Tensor, temperature: torch.Tensor, truncation: RowTruncation
) -> torch.Tensor:
    """Bool [B, V]: the tokens each row keeps. `temperature` fp32 [B], the one the row is
    sampled at (greedy rows: 1.0). Rows with no rule on keep everything; each row's result
    depends on that row alone."""
    b, v = logits.shape
    keep = torch.ones((b, v), dtype=torch.bool, device=logits.device)
    on = truncation.active_rows(v)
    if on is None or not bool(on.any()):
        return keep
    if bool(on.all()):  # (no row copies)
        return _rows_kept(logits.float(), temperature.to(torch.float32), truncation)
    rows = on.nonzero().reshape(-1)
    sub = RowTruncation(*(None if f is None else f[rows] for f in (
        truncation.top_k, truncation.top_p, truncation.min_p)))  # fmt: skip
    temp = temperature.to(torch.float32)[rows]
    keep[rows] = _rows_kept(logits[rows].float(), temp, sub)
    return keep


__all__ = ["RULE", "RowTruncation", "Truncation", "TruncationError", "truncation_mask"]
