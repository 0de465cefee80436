"""Canonical log-probabilities: fp32 log-softmax over the full vocab row, and a
vocab-parallel form whose bits do not depend on the TP degree.

Why: the engine and the trainer must produce the same number for the same (logits row,
token). Temperature is a true fp32 IEEE division `logits / T` (an expanded tensor, never
a CPU scalar, which CUDA turns into a multiply by 1/T). `log_softmax` over the contiguous
last dim is row-invariant. The vocab-parallel form cuts the vocab into G fixed leaves,
each giving (max, sum exp) at a fixed width, combined by a fixed binary tree.
"""

from __future__ import annotations

import torch

from . import _pointwise as pw

DEFAULT_VOCAB_LEAVES = 8


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    if temperature != 1.0:
        t = torch.tensor(float(temperature), dtype=torch.float32, device=x.device)
        x = x / t.expand_as(x)
    return x


def log_softmax(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Full fp32 log-softmax of logits [T, V] (after `logits / temperature` in fp32)."""
    return torch.log_softmax(_tempered(logits, temperature), dim=-1)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """fp32 logprob [T] of `token_ids[t]` under row t of logits [T, V]."""
    lp = log_softmax(logits, temperature=temperature)
    return lp.gather(-1, token_ids.reshape(-1, 1).long()).squeeze(-1)


def vocab_leaf_stats(
    logits_shard: torch.Tensor, *, leaves: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, sum exp(x - max)) per leaf of a vocab shard [T, V/tp]: two fp32 [T, leaves].

    A TP rank calls this with leaves = G // tp and all-gathers the stats (rank order).
    """
    x = _tempered(logits_shard, temperature)
    t, v = x.shape
    if v % leaves:
        raise ValueError(f"vocab shard {v} not divisible by {leaves} leaves")
    xl = x.reshape(t, leaves, v // leaves)
    m = xl.amax(-1)
    s = pw.exp(xl - m[..., None]).sum(-1)
    return m, s


def combine_leaf_stats(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """log-sum-exp [T] from per-leaf (max, sumexp) [T, G] by a fixed binary tree."""
    level = list(zip(m.unbind(-1), s.unbind(-1), strict=True))
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            (m1, s1), (m2, s2) = level[i], level[i + 1]
            mm = torch.maximum(m1, m2)
            nxt.append((mm, s1 * pw.exp(m1 - mm) + s2 * pw.exp(m2 - mm)))
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    mm, ss = level[0]
    return mm + pw.log(ss)


def token_logprobs_vocab_parallel(
    logits_shards: list[torch.Tensor],
    token_ids: torch.Tensor,
    *,
    leaves: int = DEFAULT_VOCAB_LEAVES,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Token logprobs from vocab shards (rank order) with TP-independent bits.

    Each shard gives its leaves' stats; the token's own logit comes from its owner (a sum
    of one value and zeros is exact). TP=1 is `logits_shards=[logits]`.
    """
    tp = len(logits_shards)
    if leaves % tp:
        raise ValueError(f"leaves={leaves} not divisible by TP={tp}")
    stats = [
        vocab_leaf_stats(s, leaves=leaves // tp, temperature=temperature) for s in logits_shards
    ]
    m = torch.cat([a for a, _ in stats], dim=-1)
    s = torch.cat([b for _, b in stats], dim=-1)
    lse = combine_leaf_stats(m, s)
    ids = token_ids.reshape(-1).long()
    tok = torch.zeros_like(lse)
    start = 0
    for shard in logits_shards:
        v = shard.shape[-1]
        own = (ids >= start) & (ids < start + v)
        local = (ids - start).clamp(0, v - 1)
        val = _tempered(shard, temperature).gather(-1, local[:, None]).squeeze(-1)
        tok = tok + torch.where(own, val, torch.zeros_like(val))
        start += v
    return tok - lse
