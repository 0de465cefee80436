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

from collections.abc import Iterator
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


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


@contextmanager
def _one_thread(enabled: bool) -> Iterator[None]:
    """Run the many small fixed-shape GEMMs on one thread (speed only: their bits are the
    same for any thread count, see `test_gemm_shapes_row_invariant`). Each multi-threaded
    oneDNN call opens an OpenMP region, and on a busy machine a region whose second thread is
    descheduled waits milliseconds for a ~50 us GEMM."""
    if not enabled:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _attend_fwd(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    kv_tile: int,
    block_rows: int,
) -> torch.Tensor:
    """One sequence, no autograd. q [Lq, H, D] at absolute positions q_pos [Lq]; k, v
    [Lk, Hkv, D] are the keys/values at positions 0..Lk-1 (Lk > max q_pos). Returns fp32
    [Lq, H, Dv]."""
    lq, h, d = q.shape
    lk, hkv, dv = v.shape
    g = h // hkv
    c, r = kv_tile, block_rows
    dev = q.device
    nc = -(-lk // c)
    lkp = nc * c
    # keys [Hkv, Lkp, D]; values transposed [Hkv, Dv, Lkp] (each chunk is a GEMM "weight")
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, 0, 0, lkp - lk)).permute(1, 0, 2)
    kf = kf.contiguous()
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, 0, 0, lkp - lk)).permute(1, 2, 0)
    vt = [vf[:, :, j * c : (j + 1) * c].contiguous() for j in range(nc)]
    n = lq * g
    npad = -(-n // r) * r
    nb = npad // r
    # rows ordered (query, member of the KV head's group); padded rows copy position 0
    qr = q.float().reshape(lq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n, d)
    qr = torch.nn.functional.pad(qr, (0, 0, 0, npad - n))
    rpos = torch.nn.functional.pad(q_pos.repeat_interleave(g), (0, npad - n))
    bchunks = [p // c + 1 for p in rpos.reshape(nb, r).amax(-1).tolist()]
    cpu = dev.type == "cpu"
    if cpu and _onednn_available():
        lp = torch.ops.mkldnn._linear_pointwise

        def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return lp(x, w, None, "none", [None], "")
    else:

        def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.mm(x, w.t())

    out = torch.empty(hkv, npad, dv, dtype=torch.float32, device=dev)
    kidx = torch.arange(lkp, device=dev)
    kc = [[kf[hh, j * c : (j + 1) * c] for j in range(nc)] for hh in range(hkv)]
    sb = max(1, _MAX_SCORE_ELEMS // (hkv * r * lkp))  # row blocks held at once
    for b0 in range(0, nb, sb):
        b1 = min(nb, b0 + sb)
        ncs = max(bchunks[b0:b1])
        rows = (b1 - b0) * r
        s = torch.full((hkv, rows, ncs * c), float("-inf"), device=dev)
        with _one_thread(cpu):
            for hh in range(hkv):
                for b in range(b0, b1):
                    xb = qr[hh, b * r : (b + 1) * r]
                    o = (b - b0) * r
                    for j in range(bchunks[b]):
                        s[hh, o : o + r, j * c : (j + 1) * c] = gemm(xb, kc[hh][j])
        s = s * scale
        s = s.masked_fill(kidx[: ncs * c] > rpos[b0 * r : b1 * r, None], float("-inf"))
        p = pw.exp(s - s.amax(-1, keepdim=True))
        csum = p.reshape(hkv, rows, ncs, c).sum(-1)
        l_ = csum[..., 0].clone()
        for j in range(1, ncs):
            l_ += csum[..., j]
        acc = torch.zeros(hkv, rows, dv, device=dev)
        with _one_thread(cpu):
            for hh in range(hkv):
                for b in range(b0, b1):
                    o = (b - b0) * r
                    for j in range(bchunks[b]):
                        pb = p[hh, o : o + r, j * c : (j + 1) * c].contiguous()
                        acc[hh, o : o + r] += gemm(pb, vt[j][hh])
        out[:, b0 * r : b1 * r] = acc / l_[..., None]
    return out[:, :n].reshape(hkv, lq, g, dv).permute(1, 0, 2, 3).reshape(lq, h, dv)


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


class _Attend(torch.autograd.Function):
    """Forward: the canonical kernel. Backward: plain fp32 recompute (correct, not bitwise)."""

    @staticmethod
    def forward(ctx, q, q_pos, k, v, scale, kv_tile, block_rows):
        out = _attend_fwd(q, q_pos, k, v, scale, kv_tile, block_rows)
        ctx.save_for_backward(q, q_pos, k, v, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, q_pos, k, v, out = ctx.saved_tensors
        dq, dk, dv = _attend_bwd(q, q_pos, k, v, ctx.scale, out, grad)
        return dq, None, dk, dv, None, None, None


def _attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    kv_tile: int,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """One sequence (see `_attend_fwd`); differentiable in q, k, v."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attend.apply(q, q_pos, k, v, scale, kv_tile, block_rows)
    return _attend_fwd(q, q_pos, k, v, scale, kv_tile, block_rows)


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
    [B+1] (sequence b is rows cu[b]:cu[b+1], positions from 0). Returns [T, H, Dv] in q's
    dtype."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    outs = []
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        pos = torch.arange(e - s, device=q.device)
        outs.append(_attend(q[s:e], pos, k[s:e], v[s:e], scale, kv_tile, block_rows))
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
    block_rows: int = DEFAULT_BLOCK_ROWS,
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
        out[s:e] = _attend(q[s:e], pos, kk, vv, scale, kv_tile, block_rows).to(q.dtype)
    return out
