"""The v1 GDN recurrence as differentiable torch ops, kept as a reference: what another
backend's recurrence differentiates through where the compiled CPU kernel cannot run (the
Triton backend on CUDA). Same math and gradients as `gdn.gdn_recurrence`; its forward values
are not the canonical bits.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from . import _pointwise as pw
from . import gdn as _gdn
from .gdn import L2_EPS, _batched


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
    """The v1 token loop (torch ops; non-CPU devices) over kf/qf/vf [B, T, HV, *],
    decay/beta [B, T, HV] from state st [B, HV, V, K]: (final state, outputs fp32)."""
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


def _torch_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """v1's recurrence as torch ops on batched inputs (any device, differentiable): fp32
    (o [B, T, HV, V], state [B, HV, K, V])."""
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    rep = hv // hk
    qf = (_l2norm(q.float()) / (dk**0.5)).repeat_interleave(rep, dim=2)
    kf = _l2norm(k.float()).repeat_interleave(rep, dim=2)
    vf = v.float()
    g = -pw.exp(A_log.float()) * pw.softplus(a.float() + dt_bias.float())
    decay = pw.exp(g)  # [B, T, HV]
    beta = pw.sigmoid(b.float())
    if state is None:
        st = torch.zeros(bsz, hv, dv, dk, device=q.device)
    else:
        st = state.float().transpose(-1, -2).contiguous()  # [B, HV, V, K]
    if torch.is_grad_enabled() and t > _gdn.GRAD_SEGMENT:
        # Autograd through the token loop keeps ~5 states per token: checkpoint segments
        # (the same ops in the same order; forward bits and gradients unchanged).
        outs = []
        for i0 in range(0, t, _gdn.GRAD_SEGMENT):
            seg = slice(i0, min(t, i0 + _gdn.GRAD_SEGMENT))
            st, o_seg = checkpoint(
                _recurrence_steps, st, kf[:, seg], qf[:, seg], vf[:, seg], decay[:, seg],
                beta[:, seg], use_reentrant=False,
            )  # fmt: skip
            outs.append(o_seg)
        o = torch.cat(outs, dim=1)
    else:
        st, o = _recurrence_steps(st, kf, qf, vf, decay, beta)
    return o, st.transpose(-1, -2).contiguous()


def gdn_recurrence_grad_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_recurrence` as differentiable torch ops on any device (v1's token loop): what
    another backend's recurrence differentiates through where the compiled CPU kernel cannot
    run (the Triton backend on CUDA). Same math and gradients; its forward values are not the
    canonical bits."""
    return _batched(_torch_recurrence, q, k, v, a, b, A_log, dt_bias, state)
