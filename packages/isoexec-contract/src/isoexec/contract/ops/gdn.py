"""Canonical Gated DeltaNet pieces: causal depthwise conv (+SiLU) and the gated delta rule.

Why: the chunked GDN form never matches the recurrent one bitwise, and a decode step must
equal the same token inside a prefill. The conv is an explicit shifted sum in a fixed order
(a decode step is the same sum over its conv state), and the recurrence is token-serial with
an fp32 state for prefill *and* decode, with every reduction a contiguous last-dim sum of
fixed width (the state is held internally as [.., HV, V, K] so Σ_k runs over the last dim).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from . import _pointwise as pw

L2_EPS = 1e-6
# Tokens per checkpointed segment of the recurrence under autograd (memory only, no bits).
GRAD_SEGMENT = 64


def gdn_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU. x [..., T, C], weight [C, W], state [..., W-1, C] (the
    last W-1 raw pre-conv inputs; zeros if None). Returns (y [..., T, C] in x's dtype,
    new_state [..., W-1, C] in x's dtype).

    y[t] = silu(sum_{j=0..W-1} xp[t+j] * w[:, j] (+ bias)) with xp = cat(state, x), summed
    in fp32 in the fixed order j = 0..W-1.
    """
    w = weight.shape[-1]
    if state is None:
        state = x.new_zeros(*x.shape[:-2], w - 1, x.shape[-1])
    xp = torch.cat([state.to(x.dtype), x], dim=-2)
    xf = xp.float()
    wf = weight.float()
    t = x.shape[-2]
    acc = xf[..., 0:t, :] * wf[:, 0]
    for j in range(1, w):
        acc = acc + xf[..., j : j + t, :] * wf[:, j]
    if bias is not None:
        acc = acc + bias.float()
    y = pw.silu(acc).to(x.dtype)
    return y, xp[..., xp.shape[-2] - (w - 1) :, :]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * pw.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _recurrence_steps(
    st: torch.Tensor,
    kf: torch.Tensor,
    qf: torch.Tensor,
    vf: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token loop of `gdn_recurrence` over kf/qf/vf [B, T, HV, *], decay/beta [B, T, HV]
    from state st [B, HV, V, K]: (final state, outputs [B, T, HV, V] fp32)."""
    outs = []
    for i in range(kf.shape[1]):
        kt = kf[:, i, :, None, :]  # [B, HV, 1, K]
        st = st * decay[:, i, :, None, None]
        kv_mem = (st * kt).sum(-1)  # [B, HV, V]
        delta = (vf[:, i] - kv_mem) * beta[:, i, :, None]
        st = st + delta[..., None] * kt
        outs.append((st * qf[:, i, :, None, :]).sum(-1))
    if not outs:
        return st, vf.new_empty(vf.shape[0], 0, *vf.shape[2:])
    return st, torch.stack(outs, dim=1)


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
    """Gated delta rule, token-serial. q, k [B?, T, HK, K]; v [B?, T, HV, V]; a, b
    [B?, T, HV]; A_log, dt_bias [HV]; state [B?, HV, K, V] fp32 (zeros if None).
    Returns (o [B?, T, HV, V] in v's dtype, new_state [B?, HV, K, V] fp32).

    q, k l2-normalised (eps 1e-6), q divided by sqrt(K) (as HF), k-heads repeated to v-heads,
    g = -exp(A_log)·softplus(a + dt_bias), β = sigmoid(b); per token:
    S ← S·e^g; δ = (v − Σ_k S·k)·β; S ← S + k⊗δ; o = Σ_k S·q.
    """
    batched = q.dim() == 4
    if not batched:
        q, k, v, a, b = (t.unsqueeze(0) for t in (q, k, v, a, b))
        if state is not None:
            state = state.unsqueeze(0)
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    rep = hv // hk
    qf = _l2norm(q.float()) / (dk**0.5)
    kf = _l2norm(k.float())
    qf = qf.repeat_interleave(rep, dim=2)
    kf = kf.repeat_interleave(rep, dim=2)
    vf = v.float()
    g = -pw.exp(A_log.float()) * pw.softplus(a.float() + dt_bias.float())
    decay = pw.exp(g)  # [B, T, HV]
    beta = pw.sigmoid(b.float())
    if state is None:
        st = torch.zeros(bsz, hv, dv, dk, device=q.device)
    else:
        st = state.float().transpose(-1, -2).contiguous()  # [B, HV, V, K]
    if torch.is_grad_enabled() and t > GRAD_SEGMENT:
        # Autograd through the token loop keeps ~5 states per token (T x HV x K x V floats:
        # tens of GB per sequence at training sizes). Checkpoint segments instead: only the
        # state at each segment start is kept; backward recomputes one segment at a time,
        # the same ops in the same order (forward bits and gradients unchanged).
        outs = []
        for i0 in range(0, t, GRAD_SEGMENT):
            seg = slice(i0, min(t, i0 + GRAD_SEGMENT))
            st, o_seg = checkpoint(
                _recurrence_steps, st, kf[:, seg], qf[:, seg], vf[:, seg], decay[:, seg],
                beta[:, seg], use_reentrant=False,
            )  # fmt: skip
            outs.append(o_seg)
        o = torch.cat(outs, dim=1).to(v.dtype)
    else:
        st, o = _recurrence_steps(st, kf, qf, vf, decay, beta)
        o = o.to(v.dtype)
    new_state = st.transpose(-1, -2).contiguous()
    if not batched:
        o, new_state = o[0], new_state[0]
    return o, new_state


def gdn_sequence(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    heads: tuple[int, int, int, int],
    conv_state: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    conv: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gdn_conv,
    recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gdn_recurrence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence through a GDN core, as both sides run it: `conv` over [q | k | v] channels,
    split into heads (`heads` = (HK, HV, K, V)), `recurrence`. mixed_qkv [B?, T, C], a, b
    [B?, T, HV]; with a leading batch dim B, sequences of equal length (an engine's decode
    step) run at once, each with the bits it gets alone (every op is per sequence and row).

    Returns (o [B?, T, HV, V], new conv state, new recurrent state). `conv` / `recurrence` are
    the backend's kernels (the torch ones by default); the composition itself is pure
    reshuffles.
    """
    hk, hv, kd, vd = heads
    lead, n = mixed_qkv.shape[:-2], mixed_qkv.shape[-2]
    y, new_conv = conv(mixed_qkv, conv_weight, conv_state)
    q, k, v = y.split([hk * kd, hk * kd, hv * vd], dim=-1)
    o, new_state = recurrence(
        q.reshape(*lead, n, hk, kd),
        k.reshape(*lead, n, hk, kd),
        v.reshape(*lead, n, hv, vd),
        a.reshape(*lead, n, hv),
        b.reshape(*lead, n, hv),
        A_log,
        dt_bias,
        state,
    )
    return o, new_conv, new_state
