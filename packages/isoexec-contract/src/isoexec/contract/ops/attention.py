"""Canonical causal attention (GQA): fixed-shape score and p·v GEMMs over key chunks aligned
to absolute position 0, an exact row max, fp32 softmax; one entry for packed/varlen sequences,
one for a paged KV cache.

Why: SDPA's row result depends on how many queries and keys are in the call, so a decode
step differs from the same query inside a prefill. Here every floating-point reduction has a
shape that does not depend on the call:

- Rows are (query, head-in-group) pairs of one KV head, in blocks of `block_rows` (the last
  one zero-padded). Keys are cut into chunks of `kv_tile` from position 0 (the last one
  zero-padded).
- Scores: for each (row block, key chunk) one `[block_rows, D] x [D, kv_tile]` GEMM — the
  same fixed-shape GEMM whatever the number of queries or keys (on CPU the oneDNN fp32 GEMM
  that `ops.linear` uses; its row bits do not depend on where the row sits in the block or
  on the other rows, measured). Then `* scale`, keys after the query masked to -inf.
- Row max over all keys: exact (a max has no rounding), so it equals the max over the keys
  at positions <= p whatever is masked or padded after them.
- p = exp(s - max) through the position-invariant `_pointwise.exp`; masked keys give p = 0.
- Row sum: per key chunk a contiguous last-dim sum of fixed width `kv_tile`, then the chunk
  sums added in chunk order. p·v: per (row block, key chunk) one `[block_rows, kv_tile] x
  [kv_tile, Dv]` GEMM, accumulated in chunk order. out = acc / sum.

A chunk wholly after the query contributes exact zeros (p = 0, and x + 0 == x), and inside a
chunk the masked keys multiply by p = 0 in a GEMM of the same shape; so chunks after the
query may be computed or skipped, and a row block computes only the chunks its last query
needs. The result depends only on the query, the keys/values at positions <= p, and p:
prefill, decode, chunked prefill and paged reads all give the same bits, for any number of
queries, co-batched sequences or threads.

Backward (trainer) recomputes the softmax in plain fp32 torch per query chunk: correct, not
bitwise (only forward logprobs must match).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from . import _pointwise as pw

# Keys per fixed-shape GEMM (the "tile": aligned to absolute position 0).
DEFAULT_KV_TILE = 128
# (query, head) rows per fixed-shape GEMM.
DEFAULT_BLOCK_ROWS = 32
# Cap on fp32 score elements held at once per KV head (memory only; the row grouping changes
# no bits, every op after the GEMMs being per row).
_MAX_SCORE_ELEMS = 1 << 22
# Cap on zero-padded key rows (sequences x longest padded length) gathered at once (memory).
_MAX_PADDED_KEYS = 1 << 16


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def _thread_count_settable() -> bool:
    """True unless a host replaced torch's own `set_num_threads` with a stub."""
    return torch.set_num_threads is torch._C.set_num_threads


@contextmanager
def _one_thread(enabled: bool) -> Iterator[None]:
    """Run the many small fixed-shape GEMMs on one thread (speed only: their bits are the
    same for any thread count, see `test_gemm_shapes_row_invariant`). Each multi-threaded
    oneDNN call opens an OpenMP region, and on a busy machine a region whose second thread is
    descheduled waits milliseconds for a ~50 us GEMM.

    Not where the thread count is pinned: vLLM's CPU worker binds its OpenMP threads to cores
    and replaces `torch.set_num_threads` with a function that only logs a warning (two per
    call here: thousands per generate, a sixth of a decode step), so it is left alone there.
    """
    if not enabled or torch.get_num_threads() == 1 or not _thread_count_settable():
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _gemm_fn(dev: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`x @ w.T` for the fixed-shape blocks: oneDNN's fp32 GEMM on CPU (see module doc)."""
    if dev.type == "cpu" and _onednn_available():
        lp = torch.ops.mkldnn._linear_pointwise

        def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return lp(x, w, None, "none", [None], "")

        return gemm

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w.t())

    return mm


def _attend_fwd(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_seg: torch.Tensor,
    k_pad: torch.Tensor,
    v_pad: torch.Tensor,
    scale: float,
    kv_tile: int,
    block_rows: int,
) -> torch.Tensor:
    """Several sequences at once, no autograd. q [T, H, D]: query t belongs to sequence
    q_seg[t] (non-decreasing) at absolute position q_pos[t]; k_pad, v_pad [S, Lkp, Hkv, D]:
    sequence s's keys/values at positions 0.. (Lkp a multiple of kv_tile, zeros past each
    sequence's own keys). Returns fp32 [T, H, Dv].

    Only the fixed-shape GEMMs are issued one by one (per row block x KV head x key chunk);
    everything between them is per row, so it runs batched over all sequences — the bits of a
    row are those it gets alone (rows never share a block across sequences).
    """
    t, h, d = q.shape
    ns, lkp, hkv, dv = v_pad.shape
    g = h // hkv
    c, r = kv_tile, block_rows
    dev = q.device
    nch = lkp // c
    # Rows of sequence s, in (query, member of the KV-head group) order, fill its own blocks.
    counts = torch.bincount(q_seg, minlength=ns)
    nblocks = (counts * g + r - 1) // r
    blk_start = torch.cumsum(nblocks, 0) - nblocks
    seg_start = torch.cumsum(counts, 0) - counts
    nb = int(nblocks.sum())
    i_t = torch.arange(t, device=dev) - seg_start[q_seg]
    dest = (blk_start[q_seg] * r + i_t * g)[:, None] + torch.arange(g, device=dev)  # [T, g]
    dest = dest.reshape(-1)
    qv = q.float().reshape(t, hkv, g, d).permute(0, 2, 1, 3).reshape(t * g, hkv, d)
    qb = torch.zeros(nb * r, hkv, d, device=dev)
    qb[dest] = qv
    qb = qb.view(nb, r, hkv, d).permute(0, 2, 1, 3).contiguous()  # [NB, Hkv, R, D]
    rpos = torch.zeros(nb * r, dtype=torch.long, device=dev)  # padded rows: position 0
    rpos[dest] = q_pos.long().repeat_interleave(g)
    rpos = rpos.view(nb, r)
    bchunks = (rpos.amax(-1) // c + 1).tolist()
    bseg = torch.repeat_interleave(torch.arange(ns, device=dev), nblocks).tolist()
    # keys [S, Hkv, Lkp, D] (a chunk is a contiguous GEMM "weight"); values [S, Hkv, C, Dv, c]
    kf = k_pad.float().permute(0, 2, 1, 3).contiguous()
    vf = v_pad.float().reshape(ns, nch, c, hkv, dv).permute(0, 3, 1, 4, 2).contiguous()
    gemm = _gemm_fn(dev)
    one_thread = dev.type == "cpu"
    out = torch.empty(nb, hkv, r, dv, dtype=torch.float32, device=dev)
    kidx = torch.arange(lkp, device=dev)
    sb = max(1, _MAX_SCORE_ELEMS // (hkv * r * lkp))  # row blocks held at once
    for b0 in range(0, nb, sb):
        b1 = min(nb, b0 + sb)
        ncs = max(bchunks[b0:b1])
        s = torch.full((b1 - b0, hkv, r, ncs * c), float("-inf"), device=dev)
        with _one_thread(one_thread):
            for b in range(b0, b1):
                ks = kf[bseg[b]]
                for hh in range(hkv):
                    xb, sbh, kh = qb[b, hh], s[b - b0, hh], ks[hh]
                    for j in range(bchunks[b]):
                        sbh[:, j * c : (j + 1) * c] = gemm(xb, kh[j * c : (j + 1) * c])
        s = s * scale
        s = s.masked_fill(kidx[: ncs * c] > rpos[b0:b1, None, :, None], float("-inf"))
        p = pw.exp(s - s.amax(-1, keepdim=True))
        csum = p.reshape(b1 - b0, hkv, r, ncs, c).sum(-1)
        l_ = csum[..., 0].clone()
        for j in range(1, ncs):
            l_ += csum[..., j]
        acc = torch.zeros(b1 - b0, hkv, r, dv, device=dev)
        with _one_thread(one_thread):
            for b in range(b0, b1):
                vs = vf[bseg[b]]
                for hh in range(hkv):
                    pbh, abh, vh = p[b - b0, hh], acc[b - b0, hh], vs[hh]
                    for j in range(bchunks[b]):
                        abh += gemm(pbh[:, j * c : (j + 1) * c].contiguous(), vh[j])
        out[b0:b1] = acc / l_[..., None]
    rows = out.permute(0, 2, 1, 3).reshape(nb * r, hkv, dv)[dest]
    return rows.reshape(t, g, hkv, dv).permute(0, 2, 1, 3).reshape(t, h, dv)


def _attend_bwd(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    grad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one sequence's attention (fp32 recompute, query chunks of 256)."""
    lq, h, d = q.shape
    lk, hkv, dv = v.shape
    g = h // hkv
    kf = k.float().repeat_interleave(g, 1).transpose(0, 1)  # [H, Lk, D]
    vf = v.float().repeat_interleave(g, 1).transpose(0, 1)
    dq = torch.empty(lq, h, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(h, lk, d, dtype=torch.float32, device=q.device)
    dvv = torch.zeros(h, lk, dv, dtype=torch.float32, device=q.device)
    kidx = torch.arange(lk, device=q.device)
    for c0 in range(0, lq, 256):
        qc = q[c0 : c0 + 256].float().transpose(0, 1)  # [H, n, D]
        go = grad[c0 : c0 + 256].float().transpose(0, 1)
        oc = out[c0 : c0 + 256].float().transpose(0, 1)
        s = (qc @ kf.transpose(1, 2)) * scale
        s = s.masked_fill(kidx[None, None, :] > q_pos[c0 : c0 + 256, None], float("-inf"))
        p = s.softmax(-1)
        dvv += p.transpose(1, 2) @ go
        dp = go @ vf.transpose(1, 2)
        ds = p * (dp - (go * oc).sum(-1, keepdim=True)) * scale
        dq[c0 : c0 + 256] = (ds @ kf).transpose(0, 1)
        dk += ds.transpose(1, 2) @ qc
    dk = dk.reshape(hkv, g, lk, d).sum(1).transpose(0, 1)
    dvv = dvv.reshape(hkv, g, lk, dv).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype)


def _memory_groups(lens: list[int], kv_tile: int) -> list[tuple[int, int]]:
    """Consecutive sequence ranges [s0, s1) whose zero-padded keys (sequences x longest
    padded length) stay under `_MAX_PADDED_KEYS` rows. Memory only: a row's bits do not
    depend on the group it is computed in."""
    groups: list[tuple[int, int]] = []
    s0, lmax = 0, 0
    for i, n in enumerate(lens):
        lp = max(1, -(-n // kv_tile)) * kv_tile
        if i > s0 and max(lmax, lp) * (i - s0 + 1) > _MAX_PADDED_KEYS:
            groups.append((s0, i))
            s0, lmax = i, 0
        lmax = max(lmax, lp)
    groups.append((s0, len(lens)))
    return groups


def _padded_keys(
    x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, kv_tile: int
) -> torch.Tensor:
    """[S, Lkp, Hkv, D] from packed x [T, Hkv, D]: sequence s is rows starts[s]..+lens[s],
    zero past its length (a zero key/value adds exact zeros, see module doc)."""
    lkp = max(1, -(-int(lens.max()) // kv_tile)) * kv_tile
    p = torch.arange(lkp, device=x.device)
    pad = p[None, :] >= lens[:, None]
    idx = (starts[:, None] + p[None, :]).masked_fill(pad, 0).clamp(max=max(0, x.shape[0] - 1))
    out = x[idx]
    out[pad] = 0
    return out


def _varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: list[int],
    scale: float,
    kv_tile: int,
    block_rows: int,
) -> torch.Tensor:
    """fp32 [cu[-1], H, Dv] for the packed sequences cu[b]:cu[b+1] (positions from 0)."""
    dev = q.device
    out = torch.empty(cu[-1], q.shape[1], v.shape[2], dtype=torch.float32, device=dev)
    lens = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    for s0, s1 in _memory_groups(lens, kv_tile):
        t0, t1 = cu[s0], cu[s1]
        if t1 == t0:
            continue
        glens = torch.tensor(lens[s0:s1], device=dev)
        starts = torch.tensor(cu[s0:s1], device=dev) - t0
        q_seg = torch.repeat_interleave(torch.arange(s1 - s0, device=dev), glens)
        q_pos = torch.arange(t1 - t0, device=dev) - starts[q_seg]
        kk = _padded_keys(k[t0:t1], starts, glens, kv_tile)
        vv = _padded_keys(v[t0:t1], starts, glens, kv_tile)
        out[t0:t1] = _attend_fwd(q[t0:t1], q_pos, q_seg, kk, vv, scale, kv_tile, block_rows)
    return out


class _AttendVarlen(torch.autograd.Function):
    """Forward: the canonical kernel. Backward: plain fp32 recompute per sequence (correct,
    not bitwise)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, scale, kv_tile, block_rows):
        out = _varlen_fwd(q, k, v, cu, scale, kv_tile, block_rows)
        ctx.save_for_backward(q, k, v, out)
        ctx.cu, ctx.scale = cu, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        cu = ctx.cu
        for b in range(len(cu) - 1):
            s, e = cu[b], cu[b + 1]
            if e == s:
                continue
            pos = torch.arange(e - s, device=q.device)
            gq, gk, gv = _attend_bwd(q[s:e], pos, k[s:e], v[s:e], ctx.scale, out[s:e], grad[s:e])
            dq[s:e], dk[s:e], dv[s:e] = gq, gk, gv
        return dq, dk, dv, None, None, None, None


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    kv_tile: int = DEFAULT_KV_TILE,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, H, D], k/v [T, Hkv, D], cu_seqlens
    [B+1] (sequence b is rows cu[b]:cu[b+1], positions from 0). Returns [cu[-1], H, Dv] in
    q's dtype; differentiable in q, k, v."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[-1] == cu[0]:
        return q.new_empty(0, q.shape[1], v.shape[2])
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _AttendVarlen.apply(q, k, v, cu, scale, kv_tile, block_rows)
    else:
        out = _varlen_fwd(q, k, v, cu, scale, kv_tile, block_rows)
    return out.to(q.dtype)


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
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """Causal attention reading a paged KV cache (canonical layout
    [num_blocks, block_size, Hkv, D]). Request r owns queries q[qsl[r]:qsl[r+1]] at absolute
    positions seq_len - q_len + i; its keys are positions 0..seq_len-1 (including the new
    tokens, already written). Same bits as `attention_varlen` for the same query. All
    requests of a step go through one gather and one batched pass (decode speed)."""
    dev = q.device
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    qsl = query_start_loc.long()
    nreq = qsl.shape[0] - 1
    nq = int(qsl[-1])
    if nreq <= 0 or nq == 0:
        return out
    qlens = qsl[1:] - qsl[:-1]
    lens = seq_lens[:nreq].long()
    q_seg = torch.repeat_interleave(torch.arange(nreq, device=dev), qlens)
    q_pos = lens[q_seg] - qlens[q_seg] + (torch.arange(nq, device=dev) - qsl[:-1][q_seg])
    bs, ncols = k_cache.shape[1], block_table.shape[1]
    qsl_l = qsl.tolist()
    for s0, s1 in _memory_groups(lens.tolist(), kv_tile):
        t0, t1 = qsl_l[s0], qsl_l[s1]
        if t1 == t0:
            continue
        glens = lens[s0:s1]
        lkp = max(1, -(-int(glens.max()) // kv_tile)) * kv_tile
        p = torch.arange(lkp, device=dev)
        pad = p[None, :] >= glens[:, None]
        blk = block_table[s0:s1, (p // bs).clamp(max=ncols - 1)].long().masked_fill(pad, 0)
        off = (p % bs).expand_as(blk)
        kk, vv = k_cache[blk, off], v_cache[blk, off]  # [S, Lkp, Hkv, D]
        kk[pad] = 0
        vv[pad] = 0
        rows = _attend_fwd(
            q[t0:t1], q_pos[t0:t1], q_seg[t0:t1] - s0, kk, vv, scale, kv_tile, block_rows
        )
        out[t0:t1] = rows.to(q.dtype)
    return out
