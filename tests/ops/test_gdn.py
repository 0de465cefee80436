"""GDN: whole-sequence == prefill(t) + decode steps for every split (conv and recurrence),
batch/thread invariance, match with HF's recurrent rule, chunked form as negative control."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import assert_grads_match_float64, assert_row_invariant, num_threads
from _ops_testlib import gdn_batch as _batch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from isoexec.ops import gated_rms_norm, gdn_conv, gdn_recurrence

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
    from isoexec.ops import gdn_sequence

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
    """Training keeps only segment-start states (memory): the forward bits are the no-grad
    kernel's, and the gradients are the same bits whether the backward recomputes in segments
    or in one piece."""
    import isoexec.ops.gdn as gdn_mod

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
    monkeypatch.setattr(gdn_mod, "GRAD_SEGMENT", 10**9)  # one segment
    o2, s2, grads2 = run()
    assert torch.equal(o2, ref_o) and torch.equal(s2, ref_s)
    for a, b in zip(grads, grads2, strict=True):
        assert torch.equal(a, b)


# --- the compiled kernel (v2): prefill/decode, composition, threads, accuracy, gradients ------


def _ref64(q, k, v, a, b, A_log, dt_bias, state=None):
    """The gated delta rule in float64 torch (batched, state [B, HV, K, V])."""
    q, k, v, a, b, A_log, dt_bias = (x.double() for x in (q, k, v, a, b, A_log, dt_bias))
    bsz, t, hk, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    qn = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() / kd**0.5
    kn = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    qn, kn = qn.repeat_interleave(hv // hk, 2), kn.repeat_interleave(hv // hk, 2)
    decay = (-A_log.exp() * F.softplus(a + dt_bias)).exp()
    beta = b.sigmoid()
    s = torch.zeros(bsz, hv, kd, vd, dtype=torch.float64) if state is None else state.double()
    outs = []
    for i in range(t):
        s = s * decay[:, i, :, None, None]
        kv = (s * kn[:, i, :, :, None]).sum(-2)
        delta = (v[:, i] - kv) * beta[:, i, :, None]
        s = s + kn[:, i, :, :, None] * delta[:, :, None, :]
        outs.append((s * qn[:, i, :, :, None]).sum(-2))
    return torch.stack(outs, 1), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_prefill_then_decode_every_split_bitwise(dtype):
    """A batch with a state, GQA, K and V off the 16-lane width, 70 tokens (past the kernel's
    64-token preparation chunk): prefill(t) + one-token decode steps == the whole sequence,
    output and state, for every t."""
    t = 70
    x, s0 = _batch(2, t, 2, 6, 40, 24, dtype, seed=31)
    whole, s_whole = gdn_recurrence(*x, s0)
    assert whole.dtype == dtype and s_whole.dtype == torch.float32
    for split in range(t + 1):
        o, s = gdn_recurrence(*(z[:, :split] for z in x[:5]), *x[5:], s0)
        outs = [o]
        for i in range(split, t):
            o, s = gdn_recurrence(*(z[:, i : i + 1] for z in x[:5]), *x[5:], s)
            outs.append(o)
        assert torch.equal(torch.cat(outs, 1), whole), split
        assert torch.equal(s, s_whole), split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_batch_composition_and_threads(dtype):
    """One sequence alone == the same sequence at any row of batches of 1, 2 and 5 (other
    rows random), under 1 and 2 threads; views with batch/time/head strides read in place
    give the same bits as contiguous copies."""
    hk, hv, kd, vd, t = 2, 4, 32, 48, 9
    one, s_one = _batch(1, t, hk, hv, kd, vd, dtype, seed=32)
    alone_o, alone_s = gdn_recurrence(*one, s_one)
    for nt in (1, 2):
        with num_threads(nt):
            for bsz in (1, 2, 5):
                for pos in sorted({0, bsz // 2, bsz - 1}):
                    x, s0 = _batch(bsz, t, hk, hv, kd, vd, dtype, seed=33 + bsz)
                    for dst, src in zip(x[:5], one[:5], strict=True):
                        dst[pos] = src[0]
                    x[5:] = one[5:]
                    s0[pos] = s_one[0]
                    o, s = gdn_recurrence(*x, s0)
                    assert torch.equal(o[pos], alone_o[0]), (nt, bsz, pos)
                    assert torch.equal(s[pos], alone_s[0]), (nt, bsz, pos)
    # q, k, v as split views of one [B, T, C] tensor (what gdn_sequence passes)
    y = torch.cat([one[0].flatten(2), one[1].flatten(2), one[2].flatten(2)], -1)
    q, k, v = y.split([hk * kd, hk * kd, hv * vd], -1)
    views = (q.view(1, t, hk, kd), k.view(1, t, hk, kd), v.view(1, t, hv, vd))
    assert not views[0].is_contiguous()
    o, s = gdn_recurrence(*views, *one[3:], s_one)
    assert torch.equal(o, alone_o) and torch.equal(s, alone_s)


def test_kernel_threads_1_and_2_identical():
    x, s0 = _batch(3, 40, 2, 6, 64, 64, seed=34)
    with num_threads(1):
        o1, s1 = gdn_recurrence(*x, s0)
    with num_threads(2):
        o2, s2 = gdn_recurrence(*x, s0)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_kernel_value_block_width_changes_no_bit():
    """A state column never reads another: the kernel's column blocking is speed only."""
    import isoexec.ops.gdn as gdn_mod

    x, s0 = _batch(2, 20, 1, 2, 24, 72, seed=35)
    ref = gdn_mod._forward(*x, s0, v_block=16)
    for vb in (32, 64):
        got = gdn_mod._forward(*x, s0, v_block=vb)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), vb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_accuracy_vs_float64(dtype):
    """Against a float64 reference on the same (dtype-rounded) inputs, with strong and weak
    decays (A_log and a spread wide)."""
    x, s0 = _batch(2, 50, 2, 4, 64, 32, dtype, seed=36)
    x[3] = x[3] * 4
    x[5] = x[5] * 4
    o, s = gdn_recurrence(*x, s0)
    o64, s64 = _ref64(*x, s0)
    tol_o = 1e-5 if dtype == torch.float32 else 1e-2 * o64.abs().max().item()
    assert (o.double() - o64).abs().max() < tol_o
    assert (s.double() - s64).abs().max() < 1e-5


def test_kernel_gates_extreme_values():
    """softplus/sigmoid/exp at the ends of their range: finite, and the decay and beta limits
    behave (a -> +inf: the state resets; b -> -inf: no write)."""
    x, s0 = _batch(1, 3, 1, 1, 16, 16, seed=37)
    x[3] = torch.tensor([[[-1e4], [1e4], [30.0]]])
    x[4] = torch.tensor([[[1e4], [-1e4], [-90.0]]])
    o, s = gdn_recurrence(*x, s0)
    o64, s64 = _ref64(*x, s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert (o.double() - o64).abs().max() < 1e-5 and (s.double() - s64).abs().max() < 1e-5


@pytest.mark.parametrize("segment", [16, 10**9])
def test_kernel_gradients_match_float64(monkeypatch, segment):
    """Every input's gradient (the initial state and A_log/dt_bias included, through o and the
    final state), across several checkpoint segments and with one, against float64 autograd."""
    import isoexec.ops.gdn as gdn_mod

    monkeypatch.setattr(gdn_mod, "GRAD_SEGMENT", segment)
    x, s0 = _batch(2, 37, 2, 4, 24, 40, seed=38)
    g = torch.Generator().manual_seed(39)
    w_o = torch.randn(2, 37, 4, 40, generator=g, dtype=torch.float64)
    w_s = torch.randn(2, 4, 24, 40, generator=g, dtype=torch.float64)

    def loss(fn, ins):
        o, s = fn(*ins)
        return (o.double() * w_o).sum() + (s.double() * w_s).sum()

    got = [z.clone().requires_grad_() for z in [*x, s0]]
    loss(gdn_recurrence, got).backward()
    want = [z.double().requires_grad_() for z in [*x, s0]]
    loss(_ref64, want).backward()
    for name, a, b in zip("q k v a b A_log dt_bias state".split(), got, want, strict=True):
        assert a.grad.dtype == a.dtype
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err < 1e-4 * max(1.0, b.grad.abs().max().item()), (name, err)


def test_kernel_gradients_low_precision_inputs_and_partial_requires_grad():
    """bf16 q/k/v/a/b get bf16 gradients close to float64's; inputs that need no gradient get
    none (only the state and v here)."""
    x, s0 = _batch(1, 20, 1, 2, 16, 16, torch.bfloat16, seed=40)
    v = x[2].clone().requires_grad_()
    st = s0.clone().requires_grad_()
    o, s = gdn_recurrence(x[0], x[1], v, *x[3:], st)
    (o.float().sum() + s.sum()).backward()
    assert v.grad.dtype == torch.bfloat16 and st.grad.dtype == torch.float32
    v64, s64 = x[2].double().requires_grad_(), s0.double().requires_grad_()
    o64, sf64 = _ref64(x[0], x[1], v64, *x[3:], s64)
    (o64.sum() + sf64.sum()).backward()
    assert (v.grad.double() - v64.grad).abs().max() < 2e-2 * v64.grad.abs().max()
    assert (st.grad.double() - s64.grad).abs().max() < 1e-4


def test_kernel_negative_control_torch_op_loop_differs():
    """v1's torch-op token loop (the same maths, torch's sums and exp) gives other bits than
    the kernel: the bitwise tests above would see a changed kernel."""
    from isoexec.ops import gdn_reference

    x, s0 = _batch(2, 30, 2, 4, 64, 32, seed=41)
    o, s = gdn_recurrence(*x, s0)
    o1, s1 = gdn_reference._torch_recurrence(*x, s0)
    assert not torch.equal(o, o1) or not torch.equal(s, s1)
    assert (o - o1).abs().max() < 1e-5  # same maths


# sha256 of the kernel's output on fixed inputs, at version 2. The bits are defined by the
# source alone (explicit lanes, k-ordered state sums, no FMA contraction, our own exp/log), so
# they are the same on every CPU. A change here means the op's bits changed: bump its version
# in ops/__init__.py and record the new hash.
SAVED_V2 = {
    torch.float32: "17415a4eac30f2fa",
    torch.bfloat16: "ec4898c65debd0fc",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bits_v2(dtype):
    import hashlib

    from isoexec.ops import REGISTRY

    assert REGISTRY["gdn_recurrence"].version == 2
    x, s0 = _batch(2, 33, 2, 4, 32, 48, dtype, seed=42)
    o, s = gdn_recurrence(*x, s0)
    h = hashlib.sha256(o.float().numpy().tobytes() + s.numpy().tobytes())
    assert h.hexdigest()[:16] == SAVED_V2[dtype]


def test_fingerprint_covers_the_kernel_source(monkeypatch):
    from isoexec.ops import REGISTRY, cpu_kernels, get_impl

    info = REGISTRY["gdn_recurrence"]
    assert info.version == 2 and info.param_dict()["lanes"] == "16"
    assert get_impl("gdn_recurrence") == info
    real = cpu_kernels.source_text
    monkeypatch.setattr(
        cpu_kernels, "source_text", lambda name: real(name) + ("//" if name == "gdn" else "")
    )
    assert get_impl("gdn_recurrence").source_fingerprint != info.source_fingerprint
    assert get_impl("rms_norm") == REGISTRY["rms_norm"]


def test_refuses_other_devices_and_grad_reference_runs_anywhere():
    """The op is the compiled CPU kernel: a meta (or CUDA) tensor is an error, not a silent
    fallback; the torch-loop grad reference (what the Triton backward differentiates) runs
    on any device."""
    x, s0 = _batch(1, 3, 1, 2, 16, 8, seed=43)
    meta = [t.to("meta") for t in x]
    with pytest.raises(ValueError, match="runs on CPU"):
        gdn_recurrence(*meta)
    from isoexec.ops.gdn_reference import gdn_recurrence_grad_reference

    o, st = gdn_recurrence_grad_reference(*meta)
    assert o.device.type == "meta" and st.shape == s0.shape
