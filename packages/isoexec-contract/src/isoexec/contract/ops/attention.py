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
  same fixed-shape GEMM whatever the number of queries or keys. All of a call's GEMMs run as
  the items of one `torch.bmm` (fp32; on CPU the BLAS batch GEMM): an item's row bits do not
  depend on where the row sits in the block, on the other rows, on the other items of the
  batch or on the thread count (measured, `test_gemm_items_row_invariant`). Then `* scale`,
  keys after the query masked to -inf.
- Row max over all keys: exact (a max has no rounding), so it equals the max over the keys
  at positions <= p whatever is masked or padded after them.
- p = exp(s - max) through the position-invariant `_pointwise.exp`; masked keys give p = 0.
- Row sum: per key chunk a contiguous last-dim sum of fixed width `kv_tile`, then the chunk
  sums added in chunk order. p·v: per (row block, key chunk) one `[block_rows, kv_tile] x
  [kv_tile, Dv]` GEMM, accumulated in chunk order. out = acc / sum.

A chunk wholly after the query contributes exact zeros (p = 0, and x + 0 == x), and inside a
chunk the masked keys multiply by p = 0 in a GEMM of the same shape; so chunks after the
query may be computed or skipped, and a row block computes only the chunks its last query
needs (a decode step, one block per request, computes every tile of the step and reads them
as views). The result depends only on the query, the keys/values at positions <= p, and p:
prefill, decode, chunked prefill and paged reads all give the same bits, for any number of
queries, co-batched sequences or threads.

Execution: everything between the GEMMs is per row, so a call handles all its sequences in
one batched pass (rows never share a block across sequences; zero-padded block slots exist
only inside the GEMMs, the softmax runs on real rows). The paged entry gathers the whole
step's keys with one block copy. On CUDA the torch backend is untested for invariance (the
batched GEMM's kernel choice may depend on the batch); use the Triton backend there.

Backward (trainer) recomputes the softmax in plain fp32 torch per query chunk: correct, not
bitwise (only forward logprobs must match).
"""

from __future__ import annotations

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


def _attend_fwd(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_seg: torch.Tensor,
    kf: torch.Tensor,
    vf: torch.Tensor,
    scale: float,
    kv_tile: int,
    block_rows: int,
) -> torch.Tensor:
    """Several sequences at once, no autograd. q [T, H, D]: query t belongs to sequence
    q_seg[t] (non-decreasing) at absolute position q_pos[t]; kf, vf fp32 key/value tiles
    [S, A, Hkv, B, kv_tile, D], contiguous: key chunk j = a * B + b of sequence s (positions
    j * kv_tile ..) for head h is kf[s, a, h, b] — A = 1 for packed keys, A = cache blocks
    with B chunks each for a paged cache read in its block layout; values past a sequence's
    own keys are zero. Returns fp32 [T, H, Dv].

    The GEMM items are (row block, KV head, key chunk) tiles of one fixed shape, run as one
    batched matmul per phase (scores, then probabilities x values); a batched matmul computes
    each item on its own, so an item's bits do not depend on how many run beside it.
    Everything between the GEMMs is per row. The bits of a row are those it gets alone: rows
    never share a block across sequences, and the softmax sums run over fixed-width chunks
    in chunk order.
    """
    t, h, d = q.shape
    n_seqs, n_cache_blocks, hkv, chunks_per_cache_block, c, dv = vf.shape
    g = h // hkv
    r = block_rows
    dev = q.device
    n_chunks = n_cache_blocks * chunks_per_cache_block
    keys_padded = n_chunks * c
    if c != kv_tile or kf.shape[:5] != vf.shape[:5] or kf.shape[-1] != d:
        raise ValueError(f"key tiles {tuple(kf.shape)} / {tuple(vf.shape)} for kv_tile={kv_tile}")
    # Rows of sequence s, in (query, member of the KV-head group) order, fill its own blocks.
    counts = torch.bincount(q_seg, minlength=n_seqs)
    nblocks = (counts * g + r - 1) // r
    blk_start = torch.cumsum(nblocks, 0) - nblocks
    seg_start = torch.cumsum(counts, 0) - counts
    n_row_blocks = int(nblocks.sum())
    i_t = torch.arange(t, device=dev) - seg_start[q_seg]
    dest = (blk_start[q_seg] * r + i_t * g)[:, None] + torch.arange(g, device=dev)  # [T, g]
    dest = dest.reshape(-1)
    qv = q.float().reshape(t, hkv, g, d).permute(0, 2, 1, 3).reshape(t * g, hkv, d)
    qb = torch.zeros(n_row_blocks * r, hkv, d, device=dev)
    qb[dest] = qv
    qb = qb.view(n_row_blocks, r, hkv, d).permute(0, 2, 1, 3).contiguous()  # [NB, Hkv, R, D]
    # Row k of the result is slot dest[k] of the blocks (dest ascends): padding slots exist
    # only inside the GEMMs, the per-row softmax runs on the real rows alone.
    row_of = torch.full((n_row_blocks * r,), -1, dtype=torch.long, device=dev)
    row_of[dest] = torch.arange(t * g, device=dev)
    rpos = q_pos.long().repeat_interleave(g)  # [T*g]
    bmax = torch.zeros(n_row_blocks * r, dtype=torch.long, device=dev)
    bmax[dest] = rpos
    bchunks = bmax.view(n_row_blocks, r).amax(-1) // c + 1  # key chunks each row block needs
    block_chunks = bchunks.tolist()
    block_seq = torch.repeat_interleave(torch.arange(n_seqs, device=dev), nblocks)
    out = torch.empty(t * g, hkv, dv, dtype=torch.float32, device=dev)
    qflat, kflat, vflat = qb.view(-1, r, d), kf.view(-1, c, d), vf.view(-1, c, dv)
    heads = torch.arange(hkv, device=dev)
    one_block_each = bool((nblocks == 1).all())  # block b is sequence b's only block
    kidx = torch.arange(keys_padded, device=dev).view(n_chunks, c)
    slots = torch.arange(r, device=dev)
    blocks_per_pass = max(1, _MAX_SCORE_ELEMS // (hkv * r * keys_padded))  # row blocks held at once
    for b0 in range(0, n_row_blocks, blocks_per_pass):
        b1 = min(n_row_blocks, b0 + blocks_per_pass)
        n_pass_blocks, n_chunks_used = b1 - b0, max(block_chunks[b0:b1])
        k0, k1 = _row_range(row_of, b0 * r, b1 * r)
        # the GEMM items (block, head, chunk), chunk < the block's need; one bmm each phase
        if one_block_each and n_pass_blocks == n_row_blocks:
            # one row block per sequence (decode): every key tile, in tile order, so the
            # GEMM operands are views; chunks past a row's position add exact zeros
            n_chunks_used = n_chunks
            item_block, item_cache_block, item_head, item_chunk_in_cache_block = (
                x.reshape(-1)
                for x in torch.meshgrid(
                    torch.arange(n_row_blocks, device=dev),
                    torch.arange(n_cache_blocks, device=dev),
                    heads,
                    torch.arange(chunks_per_cache_block, device=dev),
                    indexing="ij",
                )
            )
            item_chunk = item_cache_block * chunks_per_cache_block + item_chunk_in_cache_block
            k_tiles, v_tiles = kflat, vflat
        else:
            need = (
                torch.arange(n_chunks_used, device=dev)[None, None, :] < bchunks[b0:b1, None, None]
            )
            item_block, item_head, item_chunk = need.expand(
                n_pass_blocks, hkv, n_chunks_used
            ).nonzero(as_tuple=True)
            # the item's key/value tile: [seq, cache block, head, chunk in cache block]
            cache_block = item_chunk // chunks_per_cache_block
            chunk_in_block = item_chunk % chunks_per_cache_block
            seq_cache_block = block_seq[b0 + item_block] * n_cache_blocks + cache_block
            kv_tile_index = (seq_cache_block * hkv + item_head) * chunks_per_cache_block
            kv_tile_index = kv_tile_index + chunk_in_block
            k_tiles, v_tiles = (
                kflat.index_select(0, kv_tile_index),
                vflat.index_select(0, kv_tile_index),
            )
        q_tile = (b0 + item_block) * hkv + item_head  # item's query tile in qflat
        rows = row_of[(b0 + item_block)[:, None] * r + slots] - k0  # [N, R]: result row or < 0
        real = (rows >= 0).view(-1)
        # score row (result row, head, chunk) of each real (item, slot): whole-row copies
        score_row = ((rows * hkv + item_head[:, None]) * n_chunks_used + item_chunk[:, None]).view(
            -1
        )[real]
        sc = torch.bmm(qflat.index_select(0, q_tile), k_tiles.transpose(1, 2))
        s = torch.full(((k1 - k0) * hkv * n_chunks_used, c), float("-inf"), device=dev)
        s.index_copy_(0, score_row, sc.view(-1, c)[real])
        s = s.view(k1 - k0, hkv, n_chunks_used, c) * scale
        s = s.masked_fill(kidx[:n_chunks_used] > rpos[k0:k1, None, None, None], float("-inf"))
        p = pw.exp(s - s.amax(dim=(2, 3), keepdim=True))  # exact row max over all keys
        csum = p.sum(-1)  # [rows, Hkv, n_chunks_used]: fixed-width contiguous sums per chunk
        l_ = csum[:, :, 0].clone()
        for j in range(1, n_chunks_used):
            l_ += csum[:, :, j]
        p_tiles = torch.zeros(q_tile.shape[0] * r, c, device=dev)
        p_tiles[real] = p.view(-1, c).index_select(0, score_row)
        pv_items = torch.bmm(p_tiles.view(-1, r, c), v_tiles)  # [N, R, Dv]
        pv = torch.zeros((k1 - k0) * hkv * n_chunks_used, dv, device=dev)
        pv.index_copy_(0, score_row, pv_items.view(-1, dv)[real])
        pv = pv.view(k1 - k0, hkv, n_chunks_used, dv)
        acc = torch.zeros(k1 - k0, hkv, dv, device=dev)
        for j in range(
            n_chunks_used
        ):  # chunk order; a chunk a block does not need adds exact zeros
            acc += pv[:, :, j]
        out[k0:k1] = acc / l_[..., None]
    return out.reshape(t, g, hkv, dv).permute(0, 2, 1, 3).reshape(t, h, dv)


def _row_range(row_of: torch.Tensor, f0: int, f1: int) -> tuple[int, int]:
    """Result rows [k0, k1) held by block slots [f0, f1) (rows ascend with slots)."""
    real = row_of[f0:f1]
    real = real[real >= 0]
    if real.numel() == 0:
        return 0, 0
    return int(real[0]), int(real[-1]) + 1


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
    """fp32 tiles [S, 1, Hkv, Lkp / kv_tile, kv_tile, D] from packed x [T, Hkv, D] (one
    gather): sequence s is rows starts[s]..+lens[s], zero past its length (a zero key/value
    adds exact zeros)."""
    lkp = max(1, -(-int(lens.max()) // kv_tile)) * kv_tile
    p = torch.arange(lkp, device=x.device)
    pad = p[None, :] >= lens[:, None]
    idx = (starts[:, None] + p[None, :]).masked_fill(pad, 0).clamp(max=max(0, x.shape[0] - 1))
    heads = torch.arange(x.shape[1], device=x.device)
    out = _as_tiles(x[idx[:, None, :], heads[None, :, None]].float(), kv_tile)
    _zero_tail(out, lens)
    return out


def _as_tiles(x: torch.Tensor, kv_tile: int) -> torch.Tensor:
    """[S, Hkv, Lkp, D] -> the tile layout [S, 1, Hkv, Lkp / kv_tile, kv_tile, D] (a view)."""
    ns, hkv, lkp, d = x.shape
    return x.view(ns, 1, hkv, lkp // kv_tile, kv_tile, d)


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


def _block_ids(table: torch.Tensor, nbk: int, bs: int, lens: torch.Tensor) -> torch.Tensor:
    """Flat cache block ids [S * nbk] of each sequence's first `nbk` blocks; block 0 stands in
    for blocks past a sequence's length (their keys are masked, their values zeroed)."""
    cols = torch.arange(nbk, device=table.device)
    blk = table[:, cols.clamp(max=table.shape[1] - 1)].long()
    return blk.masked_fill(cols[None, :] * bs >= lens[:, None], 0).reshape(-1)


def _tiles_in_blocks(cache: torch.Tensor, blk: torch.Tensor, ns: int, kv_tile: int) -> torch.Tensor:
    """Tiles [S, blocks, Hkv, bs / kv_tile, kv_tile, D] (fp32) copied block by block from a
    cache [num_blocks, bs, Hkv, D] whose block size is a multiple of the tile: each (block,
    head) slab is already a run of whole tiles, so one gather and no transpose."""
    _nb, bs, hkv, d = cache.shape
    x = cache.permute(0, 2, 1, 3).index_select(0, blk).float()  # [S * blocks, Hkv, bs, D]
    return x.view(ns, -1, hkv, bs // kv_tile, kv_tile, d)


def _zero_tail(x: torch.Tensor, lens: torch.Tensor) -> None:
    """Tiles [S, A, Hkv, B, c, D]: zero positions >= lens[s] (position (a * B + b) * c + i)."""
    ns, na, _hkv, nbc, c, _d = x.shape
    pos = torch.arange(na * nbc * c, device=x.device).view(1, na, 1, nbc, c, 1)
    x.masked_fill_(pos >= lens.view(ns, 1, 1, 1, 1, 1), 0.0)


def _tiles_from_blocks(
    cache: torch.Tensor, blk: torch.Tensor, ns: int, lkp: int, lens: torch.Tensor, kv_tile: int
) -> torch.Tensor:
    """fp32 tiles [S, 1, Hkv, Lkp / kv_tile, kv_tile, D] from whole cache blocks `blk`
    [S * blocks] of any block size (block copies, then one transposing copy), zero past each
    sequence's length."""
    hkv, d = cache.shape[2:]
    x = cache.index_select(0, blk).view(ns, -1, hkv, d)[:, :lkp]
    x = _as_tiles(x.permute(0, 2, 1, 3).float().contiguous(), kv_tile)
    _zero_tail(x, lens)
    return x


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
    bs = k_cache.shape[1]
    qsl_l = qsl.tolist()
    for s0, s1 in _memory_groups(lens.tolist(), kv_tile):
        t0, t1 = qsl_l[s0], qsl_l[s1]
        if t1 == t0:
            continue
        glens = lens[s0:s1]
        lkp = max(1, -(-int(glens.max()) // kv_tile)) * kv_tile
        if bs % kv_tile == 0:  # whole cache blocks are whole tiles: one copy, no transpose
            nbk = -(-int(glens.max()) // bs)
            blk = _block_ids(block_table[s0:s1], nbk, bs, glens)
            kk = _tiles_in_blocks(k_cache, blk, s1 - s0, kv_tile)
            vv = _tiles_in_blocks(v_cache, blk, s1 - s0, kv_tile)
            _zero_tail(vv, glens)
        else:
            nbk = -(-lkp // bs)
            blk = _block_ids(block_table[s0:s1], nbk, bs, glens)
            kk = _tiles_from_blocks(k_cache, blk, s1 - s0, lkp, glens, kv_tile)
            vv = _tiles_from_blocks(v_cache, blk, s1 - s0, lkp, glens, kv_tile)
        rows = _attend_fwd(
            q[t0:t1], q_pos[t0:t1], q_seg[t0:t1] - s0, kk, vv, scale, kv_tile, block_rows
        )
        out[t0:t1] = rows.to(q.dtype)
    return out
