"""Triton log-probabilities: fp32 log-sum-exp over the vocab in fixed tiles, and a
vocab-parallel form whose bits do not depend on the TP degree.

Why: one program per row walks the vocab in VOCAB_TILE-wide tiles from 0 upwards with an
online (max, sum exp) in fp32, each tile a fixed-width reduction, so a row's bits depend on
that row alone. Temperature is an IEEE division (`div_rn`) of the fp32 logit, as in the
torch op. The vocab-parallel form computes (max, sum exp) per fixed leaf (one program per
(row, leaf), tiles inside the leaf) and combines leaves with the torch canonical fixed
binary tree; the token's own logit is read with the same division.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import logprobs as _torch_lp
from ._runtime import check_device, with_torch_backward

VOCAB_TILE = 1024
DEFAULT_VOCAB_LEAVES = _torch_lp.DEFAULT_VOCAB_LEAVES


@triton.jit
def _tile_stats(x_ptr, start, stop, temperature, APPLY_T: tl.constexpr, TILE: tl.constexpr):
    """(max, sum exp(x - max)) of x[start:stop] (tempered), in tile order."""
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in range(start, stop, TILE):
        offs = v0 + tl.arange(0, TILE).to(tl.int64)
        x = tl.load(x_ptr + offs, mask=offs < stop, other=float("-inf")).to(tl.float32)
        if APPLY_T:
            x = tl.math.div_rn(x, temperature)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, s


@triton.jit
def _logprobs_kernel(
    x_ptr,
    ids_ptr,
    out_ptr,
    V,
    temperature,
    APPLY_T: tl.constexpr,
    TILE: tl.constexpr,
    FULL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * V
    m, s = _tile_stats(base, 0, V, temperature, APPLY_T, TILE)
    lse = m + tl.log(s)
    if FULL:
        for v0 in range(0, V, TILE):
            offs = v0 + tl.arange(0, TILE).to(tl.int64)
            ok = offs < V
            x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
            if APPLY_T:
                x = tl.math.div_rn(x, temperature)
            tl.store(out_ptr + row * V + offs, x - lse, mask=ok)
    else:
        tok = tl.load(ids_ptr + row).to(tl.int64)
        x = tl.load(base + tok).to(tl.float32)
        if APPLY_T:
            x = tl.math.div_rn(x, temperature)
        tl.store(out_ptr + row, x - lse)


@triton.jit
def _leaf_stats_kernel(
    x_ptr,
    m_ptr,
    s_ptr,
    V,
    LEAF,
    temperature,
    LEAVES: tl.constexpr,
    APPLY_T: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    leaf = tl.program_id(1).to(tl.int64)
    m, s = _tile_stats(x_ptr + row * V, leaf * LEAF, (leaf + 1) * LEAF, temperature, APPLY_T, TILE)
    tl.store(m_ptr + row * LEAVES + leaf, m)
    tl.store(s_ptr + row * LEAVES + leaf, s)


def _run(
    logits: torch.Tensor, token_ids: torch.Tensor | None, temperature: float, tile: int
) -> torch.Tensor:
    check_device(logits)
    x = logits.reshape(-1, logits.shape[-1]).contiguous()
    t, v = x.shape
    full = token_ids is None
    out = torch.empty((t, v) if full else (t,), dtype=torch.float32, device=x.device)
    ids = (
        x.new_zeros(1, dtype=torch.int64)
        if token_ids is None
        else token_ids.reshape(-1).to(device=x.device, dtype=torch.int64).contiguous()
    )
    if t:
        _logprobs_kernel[(t,)](
            x,
            ids,
            out,
            v,
            float(temperature),
            APPLY_T=temperature != 1.0,
            TILE=tile,
            FULL=full,
        )
    return out


def log_softmax(
    logits: torch.Tensor, *, temperature: float = 1.0, vocab_tile: int = VOCAB_TILE
) -> torch.Tensor:
    """Full fp32 log-softmax of logits [T, V] (after `logits / temperature` in fp32)."""
    return with_torch_backward(  # type: ignore[return-value]
        lambda x: _run(x, None, temperature, vocab_tile),
        lambda x: _torch_lp.log_softmax(x, temperature=temperature),
        logits,
    )


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_tile: int = VOCAB_TILE,
) -> torch.Tensor:
    """fp32 logprob [T] of `token_ids[t]` under row t of logits [T, V]."""
    return with_torch_backward(  # type: ignore[return-value]
        lambda x: _run(x, token_ids, temperature, vocab_tile),
        lambda x: _torch_lp.token_logprobs(x, token_ids, temperature=temperature),
        logits,
    )


def vocab_leaf_stats(
    logits_shard: torch.Tensor,
    *,
    leaves: int,
    temperature: float = 1.0,
    vocab_tile: int = VOCAB_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, sum exp(x - max)) per leaf of a vocab shard [T, V/tp]: two fp32 [T, leaves].

    Forward only, refused under autograd: the stats have no backward, so the log-normaliser
    would silently get no gradient (a trainer scores the gathered vocab, `token_logprobs`)."""
    if torch.is_grad_enabled() and logits_shard.requires_grad:
        raise RuntimeError(
            "triton vocab_leaf_stats / token_logprobs_vocab_parallel are forward only: under "
            "autograd the log-normaliser would get no gradient; score the gathered vocab "
            "with token_logprobs, or call it under torch.no_grad()"
        )
    check_device(logits_shard)
    x = logits_shard.contiguous()
    t, v = x.shape
    if v % leaves:
        raise ValueError(f"vocab shard {v} not divisible by {leaves} leaves")
    m = torch.empty(t, leaves, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    if t:
        _leaf_stats_kernel[(t, leaves)](
            x,
            m,
            s,
            v,
            v // leaves,
            float(temperature),
            LEAVES=leaves,
            APPLY_T=temperature != 1.0,
            TILE=vocab_tile,
        )
    return m, s


combine_leaf_stats = _torch_lp.combine_leaf_stats


def token_logprobs_vocab_parallel(
    logits_shards: list[torch.Tensor],
    token_ids: torch.Tensor,
    *,
    leaves: int = DEFAULT_VOCAB_LEAVES,
    temperature: float = 1.0,
    vocab_tile: int = VOCAB_TILE,
) -> torch.Tensor:
    """Token logprobs from vocab shards (rank order) with TP-independent bits (forward only:
    refused under autograd, `vocab_leaf_stats`)."""
    tp = len(logits_shards)
    if leaves % tp:
        raise ValueError(f"leaves={leaves} not divisible by TP={tp}")
    stats = [
        vocab_leaf_stats(s, leaves=leaves // tp, temperature=temperature, vocab_tile=vocab_tile)
        for s in logits_shards
    ]
    lse = combine_leaf_stats(
        torch.cat([a for a, _ in stats], dim=-1), torch.cat([b for _, b in stats], dim=-1)
    )
    ids = token_ids.reshape(-1).long()
    tok = torch.zeros_like(lse)
    start = 0
    for shard in logits_shards:
        v = shard.shape[-1]
        own = (ids >= start) & (ids < start + v)
        local = (ids - start).clamp(0, v - 1)
        val = _torch_lp._tempered(shard, temperature).gather(-1, local[:, None]).squeeze(-1)
        tok = tok + torch.where(own, val, torch.zeros_like(val))
        start += v
    return tok - lse
