"""Canonical causal attention (GQA): fixed KV tiles from absolute position 0, fp32 online
softmax in tile order; one entry for packed/varlen sequences, one for a paged KV cache.

Why: SDPA's row result depends on how many queries and keys are in the call, so a decode
step differs from the same query inside a prefill. Here a query at absolute position p
walks KV tiles 0..p // kv_tile in order; every tile is reduced at its full width (keys past
p masked to exactly zero probability, missing keys zero-padded), and every reduction is a
contiguous last-dim reduction of fixed width (D for q.k, kv_tile for p.v and the row sum).
So the result depends only on the query, the keys/values at positions <= p, and p: prefill,
decode, chunked prefill and paged reads all give the same bits. Tiles wholly after p are
exact no-ops (alpha = exp(0) = 1, p = 0), so they may be skipped or not.
"""

from __future__ import annotations

import torch

from . import _pointwise as pw

DEFAULT_KV_TILE = 16
# Cap on elements of the [kv_heads, group, q_chunk, kv_tile, D] product (memory only; the
# query chunking does not change any bits, every op being per query row).
_MAX_CHUNK_ELEMS = 1 << 23


def _attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    kv_tile: int,
) -> torch.Tensor:
    """One sequence. q [Lq, H, D] at absolute positions q_pos [Lq]; k, v [Lk, Hkv, D] are
    the keys/values at positions 0..Lk-1 (Lk > max q_pos). Returns fp32 [Lq, H, Dv]."""
    lq, h, d = q.shape
    lk, hkv, dv = v.shape
    g = h // hkv
    nt = -(-lk // kv_tile)
    pad = nt * kv_tile - lk
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, 0, 0, pad))
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, 0, 0, pad))
    # k tiles [Hkv, nt, tile, D]; v tiles transposed [Hkv, nt, Dv, tile] (reduce last dim)
    kt = kf.reshape(nt, kv_tile, hkv, d).permute(2, 0, 1, 3).contiguous()
    vt = vf.reshape(nt, kv_tile, hkv, dv).permute(2, 0, 3, 1).contiguous()
    qf = q.float().reshape(lq, hkv, g, d).permute(1, 2, 0, 3).contiguous()  # [Hkv, G, Lq, D]
    out = torch.empty(hkv, g, lq, dv, dtype=torch.float32, device=q.device)
    chunk = max(1, _MAX_CHUNK_ELEMS // max(1, hkv * g * kv_tile * max(d, dv)))
    offs = torch.arange(kv_tile, device=q.device)
    for c0 in range(0, lq, chunk):
        qc = qf[:, :, c0 : c0 + chunk]
        pc = q_pos[c0 : c0 + chunk]
        n = qc.shape[2]
        m = torch.full((hkv, g, n), float("-inf"), device=q.device)
        l_ = torch.zeros(hkv, g, n, device=q.device)
        acc = torch.zeros(hkv, g, n, dv, device=q.device)
        last_tile = int(pc.max()) // kv_tile
        for j in range(last_tile + 1):
            s = (qc[:, :, :, None, :] * kt[:, None, None, j]).sum(-1) * scale
            masked = (j * kv_tile + offs)[None, :] > pc[:, None]  # [n, tile]
            s = s.masked_fill(masked, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alpha = pw.exp(m - m_new)
            p = pw.exp(s - m_new[..., None])
            l_ = l_ * alpha + p.sum(-1)
            pv = (p[:, :, :, None, :] * vt[:, None, None, j]).sum(-1)
            acc = acc * alpha[..., None] + pv
            m = m_new
        out[:, :, c0 : c0 + n] = acc / l_[..., None]
    return out.permute(2, 0, 1, 3).reshape(lq, h, dv)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    kv_tile: int = DEFAULT_KV_TILE,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, H, D], k/v [T, Hkv, D], cu_seqlens
    [B+1] (sequence b is rows cu[b]:cu[b+1], positions from 0). Returns [T, H, Dv] in q's
    dtype."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    outs = []
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        pos = torch.arange(e - s, device=q.device)
        outs.append(_attend(q[s:e], pos, k[s:e], v[s:e], scale, kv_tile))
    if not outs:
        return q.new_empty(0, q.shape[1], v.shape[2])
    return torch.cat(outs).to(q.dtype)


def gather_paged_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Keys (or values) at positions 0..seq_len-1 of one request from a paged cache
    [num_blocks, block_size, Hkv, D]; slot of position p = block_table[p // bs], p % bs."""
    bs = cache.shape[1]
    nb = -(-seq_len // bs)
    blocks = cache[block_table_row[:nb].long()]
    return blocks.reshape(nb * bs, *cache.shape[2:])[:seq_len]


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    kv_tile: int = DEFAULT_KV_TILE,
) -> torch.Tensor:
    """Causal attention reading a paged KV cache (canonical layout
    [num_blocks, block_size, Hkv, D]). Request r owns queries q[qsl[r]:qsl[r+1]] at absolute
    positions seq_len - q_len + i; its keys are positions 0..seq_len-1 (including the new
    tokens, already written). Same bits as `attention_varlen` for the same query."""
    qsl = [int(c) for c in query_start_loc.tolist()]
    lens = [int(c) for c in seq_lens.tolist()]
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for r in range(len(qsl) - 1):
        s, e = qsl[r], qsl[r + 1]
        if e == s:
            continue
        sl = lens[r]
        pos = torch.arange(sl - (e - s), sl, device=q.device)
        kk = gather_paged_kv(k_cache, block_table[r], sl)
        vv = gather_paged_kv(v_cache, block_table[r], sl)
        out[s:e] = _attend(q[s:e], pos, kk, vv, scale, kv_tile).to(q.dtype)
    return out
