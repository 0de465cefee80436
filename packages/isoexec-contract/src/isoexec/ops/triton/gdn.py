"""Triton Gated DeltaNet pieces: causal depthwise conv (+SiLU) and the gated delta rule.

Why: the same structure as the torch canonical ops. The conv is, per (row, t, channel), an
explicit shifted sum over the W taps in the fixed order j = 0..W-1 (decode is the same sum
over its conv state). The recurrence is token-serial with an fp32 state for prefill and
decode: one program per (sequence, value head, value tile) holds its [K, BLOCK_V] slice of
the state in registers and walks the tokens in order; every reduction over K is a
fixed-width `tl.sum`, so a whole-sequence call equals token-by-token calls bit for bit and
no sequence sees another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import gdn as _torch_gdn
from ..gdn_reference import gdn_recurrence_grad_reference
from ._runtime import check_device, pow2, store_rounded, with_torch_backward

L2_EPS = _torch_gdn.L2_EPS
CONV_BLOCK = 256
BLOCK_V = 64


@triton.jit
def _conv_kernel(
    xp_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    T,
    C,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = c < C
    base = xp_ptr + row * (T.to(tl.int64) + W - 1) * C
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(W):
        xj = tl.load(base + (t + j) * C + c, mask=ok, other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + c * W + j, mask=ok, other=0.0).to(tl.float32)
        if j == 0:
            acc = xj * wj
        else:
            acc = acc + xj * wj
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
    y = tl.math.div_rn(acc, 1.0 + tl.exp(-acc))
    store_rounded(y_ptr + (row * T + t) * C + c, y, ok)


def gdn_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    block: int = CONV_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU (same contract as the torch canonical `gdn_conv`):
    x [..., T, C], weight [C, W], state [..., W-1, C] -> (y, new_state)."""
    w = weight.shape[-1]
    if state is None:
        state = x.new_zeros(*x.shape[:-2], w - 1, x.shape[-1])
    xp = torch.cat([state.to(x.dtype), x], dim=-2)
    new_state = xp[..., xp.shape[-2] - (w - 1) :, :]

    def run(a: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        check_device(a)
        t, c = a.shape[-2], a.shape[-1]
        xp3 = torch.cat([state.to(a.dtype), a], dim=-2).reshape(-1, t + w - 1, c).contiguous()
        y = torch.empty(xp3.shape[0], t, c, dtype=a.dtype, device=a.device)
        if y.numel():
            _conv_kernel[(xp3.shape[0], t, triton.cdiv(c, block))](
                xp3,
                wt.contiguous(),
                b if b is not None else wt,
                y,
                t,
                c,
                W=w,
                BLOCK=block,
                HAS_BIAS=b is not None,
            )
        return y.reshape(a.shape)

    def ref(a: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return _torch_gdn.gdn_conv(a, wt, state, b)[0]

    y = with_torch_backward(run, ref, x, weight, bias)
    return y, new_state  # type: ignore[return-value]


@triton.jit
def _recurrence_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    alog_ptr,
    dtb_ptr,
    s0_ptr,
    o_ptr,
    s_ptr,
    T,
    HK,
    HV,
    DK,
    DV,
    sqrt_dk,
    eps,
    REP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    bi = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    vs = tl.program_id(2).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    kd = tl.arange(0, BLOCK_K)
    k_ok = kd < DK
    v_ok = vs < DV
    hk = hv // REP
    st_off = ((bi * HV + hv) * DK + kd[:, None]) * DV + vs[None, :]
    st_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_STATE:
        S = tl.load(s0_ptr + st_off, mask=st_ok, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
    a_log = tl.load(alog_ptr + hv).to(tl.float32)
    dtb = tl.load(dtb_ptr + hv).to(tl.float32)
    neg_a = -tl.exp(a_log)
    for t in range(0, T):
        row = bi * T + t
        qk_off = (row * HK + hk) * DK + kd
        q = tl.load(q_ptr + qk_off, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_off, mask=k_ok, other=0.0).to(tl.float32)
        q = q * tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(q * q, axis=0) + eps))
        q = tl.math.div_rn(q, sqrt_dk)
        k = k * tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(k * k, axis=0) + eps))
        v = tl.load(v_ptr + (row * HV + hv) * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
        x = tl.load(a_ptr + row * HV + hv).to(tl.float32) + dtb
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        decay = tl.exp(neg_a * softplus)
        beta = tl.math.div_rn(1.0, 1.0 + tl.exp(-tl.load(b_ptr + row * HV + hv).to(tl.float32)))
        S = S * decay
        kv_mem = tl.sum(S * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        store_rounded(o_ptr + (row * HV + hv) * DV + vs, o, v_ok)
    tl.store(s_ptr + st_off, S, mask=st_ok)


def gdn_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, token-serial (same contract as the torch canonical op): q, k
    [B?, T, HK, K]; v [B?, T, HV, V]; a, b [B?, T, HV]; state [B?, HV, K, V] fp32."""

    def run(*ts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        qq, kk, vv, aa, bb, al, dtb, s0 = ts
        assert qq is not None and kk is not None and vv is not None
        assert aa is not None and bb is not None and al is not None and dtb is not None
        check_device(qq)
        batched = qq.dim() == 4
        if not batched:
            qq, kk, vv, aa, bb = (x.unsqueeze(0) for x in (qq, kk, vv, aa, bb))
            if s0 is not None:
                s0 = s0.unsqueeze(0)
        bsz, t, hk, dk = qq.shape
        hv, dv = vv.shape[2], vv.shape[3]
        o = torch.empty(bsz, t, hv, dv, dtype=vv.dtype, device=vv.device)
        new_state = torch.empty(bsz, hv, dk, dv, dtype=torch.float32, device=vv.device)
        s0c = s0.float().contiguous() if s0 is not None else new_state
        _recurrence_kernel[(bsz, hv, triton.cdiv(dv, BLOCK_V))](
            qq.contiguous(),
            kk.contiguous(),
            vv.contiguous(),
            aa.contiguous(),
            bb.contiguous(),
            al.contiguous(),
            dtb.contiguous(),
            s0c,
            o,
            new_state,
            t,
            hk,
            hv,
            dk,
            dv,
            float(dk**0.5),
            L2_EPS,
            REP=hv // hk,
            BLOCK_K=pow2(dk),
            BLOCK_V=min(BLOCK_V, pow2(dv)),
            HAS_STATE=s0 is not None,
        )
        if not batched:
            return o[0], new_state[0]
        return o, new_state

    return with_torch_backward(  # type: ignore[return-value]
        run, gdn_recurrence_grad_reference, q, k, v, a, b, A_log, dt_bias, state
    )
