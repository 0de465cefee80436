"""Canonical causal attention (GQA): one fixed-order compiled CPU kernel for packed/varlen
sequences (trainer) and for a paged KV cache read in place (engine).

Why: SDPA's row result depends on how many queries and keys are in the call, so a decode
step differs from the same query inside a prefill; a BLAS GEMM's blocking depends on its
shape. Here one output row, a (query, head) pair, is computed whole by one thread with an
order written in the kernel's source (`cpu_kernels/attention.cpp`): keys 0..pos in position
order, q·k over `lanes` fixed lanes with a fixed tree, an exact row max, the canonical
`exp_nonpos`, the row sum over the same lanes, p·v accumulated key by key per output dim. The
result depends only on the query, the keys/values at positions <= p, and p: prefill, decode,
chunked prefill, paged or packed keys, any block size, batch or thread count give the same
bits, and so does any CPU that runs the same source (no FMA, no reassociation, our own exp).

v4 replaces v3's fixed-shape `torch.bmm` tiles (same invariance, other bits, and a copy of
the whole KV per step): `lanes` is the only parameter. The torch backend's attention is a CPU
kernel; on CUDA the Triton backend's attention runs (asking for this one there is an error).

Backward (trainer) recomputes the softmax in plain fp32 torch per query chunk: correct, not
bitwise (only forward logprobs must match).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from . import cpu_kernels
from ._autograd import grad_wanted

# The compiled libraries whose sources define this module's bits (in the op fingerprint).
KERNEL_LIBRARIES = ("attention",)
# fp32 lanes of the q·k dot and of the row sum (dims l, l + lanes, .. in lane l; keys j in
# lane j % lanes), combined by a fixed pairwise tree. 16 is one AVX-512 register; the bits
# do not depend on the ISA the build runs on.
DEFAULT_LANES = 16
LANES = (8, 16)
_DTYPES = cpu_kernels.DTYPE_CODES
_I64 = cpu_kernels.I64
_PTR = cpu_kernels.PTR


@cache
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("attention").isx_attention_fwd
    fn.restype = ctypes.c_int
    fn.argtypes = [
        *([_I64] * 5),
        _PTR,
        ctypes.c_int,
        _I64,
        _I64,
        _PTR,
        _PTR,
        ctypes.c_int,
        *([_I64] * 6),
        _I64,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _PTR,
        ctypes.c_float,
        _PTR,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return fn


def _check(name: str, x: torch.Tensor, ndim: int) -> None:
    if x.device.type != "cpu":
        raise ValueError(
            f"attention: {name} is on {x.device}; the torch backend's attention is a compiled CPU "
            "kernel (on CUDA run the Triton backend's)"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"attention: {name} dtype {x.dtype} unsupported ({list(_DTYPES)})")
    if x.dim() != ndim or x.stride(-1) != 1:
        raise ValueError(f"attention: {name} must be {ndim}-d with a contiguous last dim")


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    block_table: torch.Tensor | None,
    key_start: torch.Tensor | None,
    scale: float,
    lanes: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [T, H, Dv] (written into `out` when given). k/v: a cache [blocks, block_size,
    Hkv, D] read through block_table [R, max_blocks] (int32), or packed rows [N, 1, Hkv, D]
    where key j of request r is row key_start[r] + j. Query t belongs to request q_req[t] at
    absolute position q_pos[t]."""
    if lanes not in LANES:
        raise ValueError(f"attention: lanes={lanes} unsupported; the kernel has {LANES}")
    _check("q", q, 3)
    _check("k", k, 4)
    _check("v", v, 4)
    if k.dtype != v.dtype:
        raise ValueError(f"attention: k is {k.dtype}, v is {v.dtype}")
    t, h, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    if h % hkv or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if out is None:
        out = torch.empty(t, h, dv, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != (t, h, dv) or not out.is_contiguous():
        raise ValueError(f"attention: out must be contiguous fp32 {(t, h, dv)}")
    if t == 0:
        return out
    q_req = q_req.to(torch.int64).contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    bt = None if block_table is None else block_table.to(torch.int32).contiguous()
    ks = None if key_start is None else key_start.to(torch.int64).contiguous()
    rc = _kernel()(
        t, h, hkv, d, dv,
        cpu_kernels.ptr(q), _DTYPES[q.dtype], q.stride(0), q.stride(1),
        cpu_kernels.ptr(k), cpu_kernels.ptr(v), _DTYPES[k.dtype],
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k.shape[1],
        cpu_kernels.ptr(bt), 0 if bt is None else bt.stride(0), cpu_kernels.ptr(ks),
        cpu_kernels.ptr(q_req), cpu_kernels.ptr(q_pos),
        float(scale), cpu_kernels.ptr(out), lanes, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"attention kernel refused its arguments (code {rc})")
    return out


def _varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float, lanes: int
) -> torch.Tensor:
    """fp32 [cu[-1], H, Dv] for the packed sequences cu[b]:cu[b+1] (positions from 0)."""
    cut = torch.tensor(cu, dtype=torch.int64)
    lens = cut[1:] - cut[:-1]
    q_req = torch.repeat_interleave(torch.arange(len(cu) - 1), lens)
    q_pos = torch.arange(cu[-1]) - cut[:-1][q_req]
    return _run(
        q, k.unsqueeze(1), v.unsqueeze(1), q_req, q_pos,
        block_table=None, key_start=cut[:-1], scale=scale, lanes=lanes,
    )  # fmt: skip


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


class _AttendVarlen(torch.autograd.Function):
    """Forward: the canonical kernel. Backward: plain fp32 recompute per sequence (correct,
    not bitwise)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, scale, lanes):
        out = _varlen_fwd(q, k, v, cu, scale, lanes)
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
        return dq, dk, dv, None, None, None


class _PlainVarlen(torch.autograd.Function):
    """Forward: plain fp32 torch softmax attention (any device, not the canonical bits).
    Backward: the same recompute as `_AttendVarlen`'s."""

    @staticmethod
    def forward(ctx, q, k, v, cu, scale):
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
        g = q.shape[1] // k.shape[1]
        for b in range(len(cu) - 1):
            s, e = cu[b], cu[b + 1]
            qq = q[s:e].float().transpose(0, 1)
            kk = k[s:e].float().repeat_interleave(g, 1).transpose(0, 1)
            vv = v[s:e].float().repeat_interleave(g, 1).transpose(0, 1)
            sc = (qq @ kk.transpose(1, 2)) * scale
            mask = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
            out[s:e] = (sc.masked_fill(mask, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
        ctx.save_for_backward(q, k, v, out)
        ctx.cu, ctx.scale = cu, scale
        return out

    backward = _AttendVarlen.backward


def attention_varlen_grad_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """What another backend's attention differentiates through (the Triton backend on CUDA,
    where the compiled CPU kernel cannot run): the same gradients as `attention_varlen`'s, with
    a plain torch forward on any device. Its forward values are not the canonical bits."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    return _PlainVarlen.apply(q, k, v, cu, scale).to(q.dtype)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    lanes: int = DEFAULT_LANES,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, H, D], k/v [T, Hkv, D], cu_seqlens
    [B+1] (sequence b is rows cu[b]:cu[b+1], positions from 0). Returns [cu[-1], H, Dv] in
    q's dtype; differentiable in q, k, v."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[-1] == cu[0]:
        return q.new_empty(0, q.shape[1], v.shape[2])
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if grad_wanted(q, k, v):
        out = _AttendVarlen.apply(q, k, v, cu, scale, lanes)
    else:
        out = _varlen_fwd(q, k, v, cu, scale, lanes)
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


@dataclass(frozen=True)
class PagedQueries:
    """Where each query of a paged step sits: what every attention layer of the step shares.

    Computing it is a dozen small torch ops, about as long as the kernel itself at decode, so
    an engine computes it once per step (`paged_queries`) and hands it to every layer."""

    count: int  # real queries (the step's last query_start_loc)
    request: torch.Tensor  # int64 [count]: the request each query belongs to
    position: torch.Tensor  # int64 [count]: its absolute position
    block_table: torch.Tensor  # int32 contiguous [requests, max_blocks]


def paged_queries(
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> PagedQueries:
    """Request r owns queries qsl[r]:qsl[r+1] at positions seq_len - q_len + i."""
    qsl = query_start_loc.long()
    nreq = qsl.shape[0] - 1
    nq = int(qsl[-1]) if nreq > 0 else 0
    if nreq <= 0 or nq == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return PagedQueries(0, empty, empty, block_table[:0].to(torch.int32))
    qlens = qsl[1:] - qsl[:-1]
    lens = seq_lens[:nreq].long()
    q_req = torch.repeat_interleave(torch.arange(nreq), qlens, output_size=nq)
    q_pos = lens[q_req] - qlens[q_req] + (torch.arange(nq) - qsl[:-1][q_req])
    bt = block_table[:nreq].to(torch.int32).contiguous()
    return PagedQueries(nq, q_req, q_pos, bt)


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    lanes: int = DEFAULT_LANES,
    queries: PagedQueries | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention reading a paged KV cache in place (layout [num_blocks, block_size,
    Hkv, D], any strides with a contiguous last dim). Request r owns queries
    q[qsl[r]:qsl[r+1]] at absolute positions seq_len - q_len + i; its keys are positions
    0..seq_len-1 (including the new tokens, already written). Same bits as
    `attention_varlen` for the same query.

    `queries`: the step's `paged_queries(block_table, seq_lens, query_start_loc)`, computed
    once for all layers (the three tensors are then not read). `out`: a [T, H, Dv] tensor the
    result is written into (rows past the real queries zeroed) instead of a new one; in fp32, a
    contiguous `out` receives the kernel's rows directly, without a copy."""
    if queries is None:
        queries = paged_queries(block_table, seq_lens, query_start_loc)
    shape = (q.shape[0], q.shape[1], v_cache.shape[-1])
    if out is None:
        out = q.new_empty(shape)
    elif tuple(out.shape) != shape:
        raise ValueError(f"attention: out is {tuple(out.shape)}, the result {shape}")
    nq = queries.count
    if nq < shape[0]:
        out[nq:].zero_()
    if nq == 0:
        return out
    # The result is rounded to q's dtype (then stored in out's); fp32 rows go in directly.
    direct = q.dtype == out.dtype == torch.float32 and out.is_contiguous()
    rows = _run(
        q[:nq], k_cache, v_cache, queries.request, queries.position,
        block_table=queries.block_table, key_start=None, scale=scale, lanes=lanes,
        out=out[:nq] if direct else None,
    )  # fmt: skip
    if not direct:
        out[:nq] = rows.to(q.dtype)
    return out
