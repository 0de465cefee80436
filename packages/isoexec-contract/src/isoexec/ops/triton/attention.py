"""Triton causal attention (GQA): one program per (query token, query head), fixed KV tiles
from absolute position 0, fp32 online softmax in tile order; packed (varlen) and paged KV.

Why: the same structure as the torch canonical op, so prefill row == decode. A query at
absolute position p walks KV tiles 0..p // KV_TILE in order; every tile is reduced at its
full width with keys past p masked to exactly zero probability (missing keys load as 0),
q·k is a fixed-width `tl.sum` over D, p·v and the row sum fixed-width `tl.sum`s over the
tile. Nothing depends on the number of queries, where a chunk starts, or which requests
share the launch; varlen and paged only differ in how a key position maps to an address.
No `tl.dot` (its per-row bits would depend on the MMA shape chosen for the query block).

The paged form reads the cache in place: the kernel gets the cache's block, slot and head
strides, so the engine's K/V views of its `[num_blocks, Hkv, block_size, 2 * D]` cache
(strided, V starting D elements into each row) are read where they are, with the very loads
a contiguous copy would give, and nothing is copied per layer call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import attention as _torch_attn
from ._runtime import check_device, pow2, store_rounded, with_torch_backward

# The Triton kernel keeps its own 16-key tile (a separate backend with its own bits; the torch
# kernel moved to 128-key fixed-shape GEMM chunks in attention v2).
DEFAULT_KV_TILE = 16


@triton.jit
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qpos_ptr,
    kbase_ptr,
    req_ptr,
    bt_ptr,
    scale,
    H,
    D,
    DV,
    HKV_STRIDE,
    HKV_STRIDE_V,
    ROW_STRIDE,
    ROW_STRIDE_V,
    BLOCK_STRIDE,
    BLOCK_STRIDE_V,
    BT_STRIDE,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_TILE: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    pos = tl.load(qpos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < D
    dv_ok = dv < DV
    q = tl.load(q_ptr + (t * H + h) * D + d, mask=d_ok, other=0.0).to(tl.float32)
    if PAGED:
        req = tl.load(req_ptr + t).to(tl.int64)
    else:
        kbase = tl.load(kbase_ptr + t).to(tl.int64)
    offs = tl.arange(0, KV_TILE)
    m = tl.full((), float("-inf"), tl.float32)
    lsum = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for j in range(0, pos // KV_TILE + 1):
        kp = j * KV_TILE + offs
        valid = kp <= pos
        if PAGED:  # block, then slot within it (ROW_STRIDE is the slot stride)
            blk = tl.load(bt_ptr + req * BT_STRIDE + kp // PAGE, mask=valid, other=0)
            blk = blk.to(tl.int64)
            slot = kp % PAGE
            koff = blk * BLOCK_STRIDE + slot * ROW_STRIDE
            voff = blk * BLOCK_STRIDE_V + slot * ROW_STRIDE_V
        else:
            rows = kbase + kp
            koff = rows * ROW_STRIDE
            voff = rows * ROW_STRIDE_V
        kt = tl.load(
            k_ptr + koff[:, None] + hk * HKV_STRIDE + d[None, :],
            mask=valid[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        lsum = lsum * alpha + tl.sum(p, axis=0)
        vt = tl.load(
            v_ptr + voff[:, None] + hk * HKV_STRIDE_V + dv[None, :],
            mask=valid[:, None] & dv_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m = m_new
    store_rounded(o_ptr + (t * H + h) * DV + dv, tl.math.div_rn(acc, lsum), dv_ok)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qpos: torch.Tensor,
    kbase: torch.Tensor,
    req: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    kv_tile: int,
    page: int,
    paged: bool,
) -> torch.Tensor:
    """q [T, H, D]; k/v [rows, Hkv, D] (varlen) or [num_blocks, block_size, Hkv, D] (paged),
    any strides but a contiguous last dim; they are read in place."""
    check_device(q)
    t, h, d = q.shape
    hkv, dv = v.shape[-2], v.shape[-1]
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "the head dim must be contiguous"
    # (block, row or slot, head) strides; varlen has no blocks
    ks = k.stride() if paged else (0, *k.stride())
    vs = v.stride() if paged else (0, *v.stride())
    q = q.contiguous()
    out = torch.empty(t, h, dv, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    _attn_kernel[(t, h)](
        q,
        k,
        v,
        out,
        qpos,
        kbase,
        req,
        block_table,
        float(scale),
        h,
        d,
        dv,
        ks[2],
        vs[2],
        ks[1],
        vs[1],
        ks[0],
        vs[0],
        block_table.stride(0) if block_table.dim() == 2 else 0,
        GROUP=h // hkv,
        BLOCK_D=pow2(d),
        BLOCK_DV=pow2(dv),
        KV_TILE=kv_tile,
        PAGED=paged,
        PAGE=page,
    )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    kv_tile: int = DEFAULT_KV_TILE,
) -> torch.Tensor:
    """Causal attention over packed sequences (same contract as the torch canonical op)."""

    def run(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        cu = cu_seqlens.to(device=qq.device, dtype=torch.int64)
        lens = cu[1:] - cu[:-1]
        starts = torch.repeat_interleave(cu[:-1], lens, output_size=qq.shape[0])
        qpos = (torch.arange(qq.shape[0], device=qq.device) - starts).to(torch.int32)
        dummy = torch.zeros(1, dtype=torch.int32, device=qq.device)
        return _launch(
            qq,
            _rows(kk),
            _rows(vv),
            qpos,
            starts.to(torch.int32),
            dummy,
            dummy,
            scale=scale,
            kv_tile=kv_tile,
            page=1,
            paged=False,
        )

    def ref(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return _torch_attn.attention_varlen_grad_reference(qq, kk, vv, cu_seqlens, scale=scale)

    return with_torch_backward(run, ref, q, k, v)  # type: ignore[return-value]


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
    """Causal attention reading a paged cache [num_blocks, block_size, Hkv, D] (same contract
    as the torch canonical op; forward only: the engine does not train). The caches are read
    in place through their block, slot and head strides (e.g. the engine's views of its
    `[num_blocks, Hkv, block_size, 2 * D]` cache); only a head dim with a stride other than 1
    is copied first."""
    dev = q.device
    qsl = query_start_loc.to(device=dev, dtype=torch.int64)
    qlen = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(
        torch.arange(qlen.numel(), device=dev), qlen, output_size=q.shape[0]
    )
    i_in_req = torch.arange(q.shape[0], device=dev) - qsl[:-1][req]
    sl = seq_lens.to(device=dev, dtype=torch.int64)
    qpos = (sl[req] - qlen[req] + i_in_req).to(torch.int32)
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    return _launch(
        q,
        k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous(),
        v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous(),
        qpos,
        dummy,
        req.to(torch.int32),
        block_table.to(device=dev, dtype=torch.int32).contiguous(),
        scale=scale,
        kv_tile=kv_tile,
        page=k_cache.shape[1],
        paged=True,
    )


gather_paged_kv = _torch_attn.gather_paged_kv
