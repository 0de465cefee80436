"""GDN: whole-sequence == prefill(t) + decode steps for every split (conv and recurrence),
batch/thread invariance, match with HF's recurrent rule, chunked form as negative control."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import assert_grads_match_float64, assert_row_invariant, num_threads
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from isoexec.contract.ops import gated_rms_norm, gdn_conv, gdn_recurrence

HK, HV, K, V = 2, 4, 16, 8
C, W = 40, 4


def _inputs(t, dtype=torch.float32, seed=0, b=None):
    g = torch.Generator().manual_seed(seed)
    lead = () if b is None else (b,)

    def r(*s):
        return torch.randn(*lead, *s, generator=g).to(dtype)

    q, k, v, a, bb = r(t, HK, K), r(t, HK, K), r(t, HV, V), r(t, HV), r(t, HV)
    A_log, dt_bias = torch.randn(HV, generator=g), torch.randn(HV, generator=g)
    return q, k, v, a, bb, A_log, dt_bias


def _hf(q, k, v, a, b, A_log, dt_bias, chunk=None):
    g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    beta = b.float().sigmoid()
    qq, kk = (x.float().repeat_interleave(HV // HK, -2)[None] for x in (q, k))
    args = (qq, kk, v.float()[None], g[None], beta[None])
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    if chunk:
        o, s = torch_chunk_gated_delta_rule(*args, chunk_size=chunk, **kw)
    else:
        o, s = torch_recurrent_gated_delta_rule(*args, **kw)
    return o[0], s[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrence_every_split_equals_whole(dtype):
    t = 17
    x = _inputs(t, dtype)
    q, k, v, a, b, A_log, dtb = x
    whole, s_whole = gdn_recurrence(*x)
    assert s_whole.dtype == torch.float32 and whole.dtype == dtype
    for split in range(t + 1):
        o, s = gdn_recurrence(q[:split], k[:split], v[:split], a[:split], b[:split], A_log, dtb)
        outs = [o]
        for i in range(split, t):
            sl = slice(i, i + 1)
            o, s = gdn_recurrence(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dtb, s)
            outs.append(o)
        assert torch.equal(torch.cat(outs), whole), split
        assert torch.equal(s, s_whole), split


def test_negative_control_chunked_rule_differs_from_recurrent():
    """HF's chunked gated-delta rule (what prefill kernels use) is not the recurrent one."""
    x = _inputs(40, seed=1)
    o_rec, _ = _hf(*x)
    o_chunk, _ = _hf(*x, chunk=16)
    o_chunk8, _ = _hf(*x, chunk=8)
    assert not torch.equal(o_rec, o_chunk) or not torch.equal(o_chunk, o_chunk8)


def test_matches_hf_recurrent():
    x = _inputs(30, seed=2)
    o, s = gdn_recurrence(*x)
    o_hf, s_hf = _hf(*x)
    assert (o - o_hf).abs().max() < 1e-5 and (s - s_hf).abs().max() < 1e-5


def test_batch_and_thread_invariant():
    """A sequence's outputs are the same alone (B=1) and inside a batch of B sequences."""
    t = 6
    alone_o, alone_s = gdn_recurrence(*_inputs(t, seed=3))
    for nt in (1, 2):
        with num_threads(nt):
            for bsz in (2, 7, 16):
                q, k, v, a, b, _, _ = _inputs(t, seed=4, b=bsz)
                one = _inputs(t, seed=3)
                for dst, src in zip((q, k, v, a, b), one[:5], strict=True):
                    dst[bsz // 2] = src
                o, s = gdn_recurrence(q, k, v, a, b, one[5], one[6])
                assert torch.equal(o[bsz // 2], alone_o) and torch.equal(s[bsz // 2], alone_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_every_split_equals_whole_and_accurate(dtype):
    g = torch.Generator().manual_seed(5)
    t = 13
    x, w = torch.randn(t, C, generator=g).to(dtype), torch.randn(C, W, generator=g).to(dtype)
    y, st_ = gdn_conv(x, w)
    assert torch.equal(st_, x[-(W - 1) :])
    for split in range(t + 1):
        y1, s = gdn_conv(x[:split], w)
        ys = [y1]
        for i in range(split, t):
            yi, s = gdn_conv(x[i : i + 1], w, s)
            ys.append(yi)
        assert torch.equal(torch.cat(ys), y) and torch.equal(s, st_), split
    ref = F.silu(
        F.conv1d(x.double().T[None], w.double()[:, None], padding=W - 1, groups=C)[..., :t]
    )[0].T
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (y.double() - ref).abs().max() < tol


def test_conv_negative_control_native_conv1d_split_differs():
    """torch's conv1d over the whole prefill vs. one decode step over the state differs."""
    g = torch.Generator().manual_seed(6)
    t = 64
    x, w = torch.randn(t, C, generator=g), torch.randn(C, W, generator=g)
    whole = F.silu(F.conv1d(x.T[None], w[:, None], padding=W - 1, groups=C)[..., :t])[0].T
    diffs = 0
    for i in range(W, t):
        step = F.silu((x[i - W + 1 : i + 1] * w.T).sum(0))  # what a decode update does
        diffs += not torch.equal(step, whole[i])
    assert diffs > 0


@settings(max_examples=5, deadline=None)
@given(t=st.integers(1, 12), split=st.integers(0, 12), seed=st.integers(0, 1000))
def test_conv_then_recurrence_prefill_decode_hypothesis(t, split, seed):
    split = min(split, t)
    x = _inputs(t, seed=seed)
    whole, s_whole = gdn_recurrence(*x)
    o1, s1 = gdn_recurrence(*(z[:split] for z in x[:5]), *x[5:])
    o2, s2 = gdn_recurrence(*(z[split:] for z in x[:5]), *x[5:], s1)
    assert torch.equal(torch.cat([o1, o2]), whole) and torch.equal(s2, s_whole)


def test_gated_norm_after_recurrence_row_invariant():
    w = torch.randn(V, generator=torch.Generator().manual_seed(7))
    assert_row_invariant(
        lambda o, z: gated_rms_norm(o, z, w, 1e-6),
        lambda m, g: (torch.randn(m, V, generator=g), torch.randn(m, V, generator=g)),
    )


def test_backward_matches_float64():
    q, k, v, a, b, A_log, dtb = _inputs(5, seed=8)

    def ref(q, k, v, a, b):
        qn = q / q.square().sum(-1, keepdim=True).add(1e-6).sqrt() / K**0.5
        kn = k / k.square().sum(-1, keepdim=True).add(1e-6).sqrt()
        qn, kn = qn.repeat_interleave(2, 1), kn.repeat_interleave(2, 1)
        gg = -A_log.double().exp() * F.softplus(a + dtb.double())
        beta = b.sigmoid()
        s = torch.zeros(HV, K, V, dtype=torch.float64)
        outs = []
        for i in range(q.shape[0]):
            s = s * gg[i].exp()[:, None, None]
            delta = (v[i] - (s * kn[i][..., None]).sum(-2)) * beta[i][:, None]
            s = s + kn[i][..., None] * delta[:, None, :]
            outs.append((s * qn[i][..., None]).sum(-2))
        return torch.stack(outs)

    assert_grads_match_float64(
        lambda q, k, v, a, b: gdn_recurrence(q, k, v, a, b, A_log, dtb)[0], ref, (q, k, v, a, b)
    )
    x = torch.randn(7, C, generator=torch.Generator().manual_seed(9))
    w = torch.randn(C, W, generator=torch.Generator().manual_seed(10))
    assert_grads_match_float64(
        lambda x, w: gdn_conv(x, w)[0],
        lambda x, w: F.silu(F.conv1d(x.T[None], w[:, None], padding=W - 1, groups=C)[..., :7])[0].T,
        (x, w),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "with_state"), [(1, True), (6, True), (6, False)])
def test_sequence_batched_equals_each_alone(dtype, t, with_state):
    """An engine runs equal-length requests (a decode step, equal prompts) as one batch
    through `gdn_sequence`; each must get the bits it gets alone (output and states)."""
    from isoexec.contract.ops import gdn_sequence

    g = torch.Generator().manual_seed(21)
    hk, hv, kd, vd, w, bsz = 2, 4, 16, 8, 4, 5
    c = 2 * hk * kd + hv * vd
    conv_w = torch.randn(c, w, generator=g).to(dtype)
    a_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    x = torch.randn(bsz, t, c, generator=g).to(dtype)
    a, b = (torch.randn(bsz, t, hv, generator=g).to(dtype) for _ in range(2))
    conv_state = torch.randn(bsz, w - 1, c, generator=g).to(dtype) if with_state else None
    state = torch.randn(bsz, hv, kd, vd, generator=g) if with_state else None
    kw = {"A_log": a_log, "dt_bias": dt_bias, "heads": (hk, hv, kd, vd)}
    o, new_conv, new_state = gdn_sequence(x, conv_w, a, b, conv_state=conv_state, state=state, **kw)
    for i in range(bsz):
        oi, ci, si = gdn_sequence(
            x[i], conv_w, a[i], b[i],
            conv_state=None if conv_state is None else conv_state[i],
            state=None if state is None else state[i], **kw,
        )  # fmt: skip
        assert torch.equal(o[i], oi) and torch.equal(new_conv[i], ci), i
        assert torch.equal(new_state[i], si), i


def test_recurrence_under_autograd_is_checkpointed_same_bits_and_grads(monkeypatch):
    """Training keeps only segment-start states (memory), with the forward bits and the
    gradients of autograd through the whole token loop."""
    import isoexec.contract.ops.gdn as gdn_mod

    g = torch.Generator().manual_seed(22)
    t, hk, hv, kd, vd = 150, 2, 4, 16, 8
    ins = [
        torch.randn(t, hk, kd, generator=g),
        torch.randn(t, hk, kd, generator=g),
        torch.randn(t, hv, vd, generator=g),
        torch.randn(t, hv, generator=g),
        torch.randn(t, hv, generator=g),
    ]
    a_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    state = torch.randn(hv, kd, vd, generator=g)

    def run() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        xs = [x.clone().requires_grad_() for x in ins]
        o, s = gdn_recurrence(*xs, a_log, dt_bias, state)
        (o.square().sum() + s.sum()).backward()
        return o.detach(), s.detach(), [x.grad for x in xs]

    with torch.no_grad():
        ref_o, ref_s = gdn_recurrence(*ins, a_log, dt_bias, state)
    o, s, grads = run()  # checkpointed (t > GRAD_SEGMENT)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    monkeypatch.setattr(gdn_mod, "GRAD_SEGMENT", 10**9)  # autograd through the whole loop
    o2, s2, grads2 = run()
    assert torch.equal(o2, ref_o) and torch.equal(s2, ref_s)
    for a, b in zip(grads, grads2, strict=True):
        assert torch.equal(a, b)
