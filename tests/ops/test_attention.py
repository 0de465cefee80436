"""attention: decode == last query of prefill, paged == packed, chunked prefill == whole,
independence from co-batched sequences and threads; accuracy; backward; SDPA control."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import assert_grads_match_float64, num_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from isoexec.ops import attention_paged, attention_varlen

H, HKV, D = 4, 2, 32
SCALE = D**-0.5


def _qkv(t, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, D, generator=g).to(dtype) for h in (H, HKV, HKV))


def _ref64(q, k, v):
    t = q.shape[0]
    qd, kd, vd = (x.double() for x in (q, k, v))
    kd, vd = kd.repeat_interleave(H // HKV, 1), vd.repeat_interleave(H // HKV, 1)
    s = torch.einsum("thd,shd->hts", qd, kd) * SCALE
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vd)


def _paged(k, v, block_size, num_blocks, seed):
    """Write k/v of one sequence into a random cache at a random block order."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, HKV, D, generator=g).to(k.dtype)
    vc = torch.randn(num_blocks, block_size, HKV, D, generator=g).to(k.dtype)
    perm = torch.randperm(num_blocks, generator=g)
    for p in range(k.shape[0]):
        kc[perm[p // block_size], p % block_size] = k[p]
        vc[perm[p // block_size], p % block_size] = v[p]
    return kc, vc, perm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_prefill_and_paged_equals_packed(dtype):
    t = 45
    q, k, v = _qkv(t, dtype)
    full = attention_varlen(q, k, v, torch.tensor([0, t]), scale=SCALE)
    kc, vc, perm = _paged(k, v, block_size=8, num_blocks=9, seed=1)
    for n in range(1, t + 1):
        # decode: query n-1 against the cached prefix 0..n-1 (paged, random block order)
        got = attention_paged(
            q[n - 1 : n], kc, vc, perm[None], torch.tensor([n]), torch.tensor([0, 1]), scale=SCALE
        )
        assert torch.equal(got[0], full[n - 1]), n
        # the last query of a prefill of the prefix == the same row of the full prefill
        pre = attention_varlen(q[:n], k[:n], v[:n], torch.tensor([0, n]), scale=SCALE)
        assert torch.equal(pre[-1], full[n - 1]), n
    # whole prefill through the paged entry == packed
    got = attention_paged(
        q, kc, vc, perm[None], torch.tensor([t]), torch.tensor([0, t]), scale=SCALE
    )
    assert torch.equal(got, full)


def test_negative_control_sdpa_decode_differs_from_prefill():
    t = 45
    q, k, v = _qkv(t)
    qh, kh, vh = (
        x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    )
    full = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)[0].transpose(0, 1)
    diffs = 0
    for n in range(2, t + 1):
        dec = F.scaled_dot_product_attention(qh[:, :, n - 1 : n], kh[:, :, :n], vh[:, :, :n])
        diffs += not torch.equal(dec[0].transpose(0, 1)[0], full[n - 1])
    assert diffs > 0


@settings(max_examples=8, deadline=None)
@given(
    t=st.integers(1, 60),
    split=st.integers(0, 60),
    block_size=st.sampled_from([4, 8, 16]),
    lanes=st.sampled_from([8, 16]),
    seed=st.integers(0, 10_000),
)
def test_chunked_prefill_any_split_equals_whole(t, split, block_size, lanes, seed):
    split = min(split, t)
    q, k, v = _qkv(t, seed=seed)
    whole = attention_varlen(q, k, v, torch.tensor([0, t]), scale=SCALE, lanes=lanes)
    nb = -(-t // block_size) + 3
    kc, vc, perm = _paged(k, v, block_size, nb, seed)
    outs = []
    for s, e in ((0, split), (split, t)):
        if e > s:
            outs.append(
                attention_paged(
                    q[s:e],
                    kc,
                    vc,
                    perm[None],
                    torch.tensor([e]),
                    torch.tensor([0, e - s]),
                    scale=SCALE,
                    lanes=lanes,
                )
            )
    assert torch.equal(torch.cat(outs), whole)


def test_independent_of_cobatched_sequences_and_threads():
    """A sequence's rows are the same alone and packed between others (varlen and paged,
    mixed prefill/decode batch), with 1 and 2 threads."""
    t = 23
    q, k, v = _qkv(t, seed=3)
    alone = attention_varlen(q, k, v, torch.tensor([0, t]), scale=SCALE)
    for nt in (1, 2):
        with num_threads(nt):
            for others in ((1,), (7, 40), (64,)):
                seqs = [_qkv(n, seed=n) for n in others]
                parts = [*seqs[:1], (q, k, v), *seqs[1:]]
                cat = [torch.cat([p[i] for p in parts]) for i in range(3)]
                lens = [p[0].shape[0] for p in parts]
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
                out = attention_varlen(*cat, cu, scale=SCALE)
                s = lens[0] if len(parts) > 1 else 0
                assert torch.equal(out[s : s + t], alone)
            # paged batch: request 0 decodes its last token, request 1 is another sequence
            bs, nb = 8, 8
            kc, vc, perm = _paged(k, v, bs, nb, seed=5)
            q2, k2, v2 = _qkv(10, seed=9)
            kc2, vc2, perm2 = _paged(k2, v2, bs, nb, seed=6)
            kcat, vcat = torch.cat([kc, kc2]), torch.cat([vc, vc2])
            bt = torch.stack([perm, perm2 + nb])
            out = attention_paged(
                torch.cat([q[-1:], q2]),
                kcat,
                vcat,
                bt,
                torch.tensor([t, 10]),
                torch.tensor([0, 1, 11]),
                scale=SCALE,
            )
            assert torch.equal(out[0], alone[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_vs_float64(dtype):
    q, k, v = _qkv(50, dtype, seed=4)
    out = attention_varlen(q, k, v, torch.tensor([0, 50]), scale=SCALE).double()
    ref = _ref64(q, k, v)
    if dtype == torch.float32:
        assert (out - ref).abs().max() < 1e-5
    else:  # one rounding of an fp32-accurate result
        eps = torch.finfo(dtype).eps
        assert ((out - ref).abs() <= ref.abs() * eps + 1e-5).all()


def test_backward_matches_float64():
    q, k, v = _qkv(12, seed=7)
    cu = torch.tensor([0, 5, 12])

    def ref(q, k, v):
        return torch.cat([_ref64(q[:5], k[:5], v[:5]), _ref64(q[5:], k[5:], v[5:])])

    assert_grads_match_float64(
        lambda q, k, v: attention_varlen(q, k, v, cu, scale=SCALE), ref, (q, k, v)
    )


# --- the compiled kernel (v4): long rows, lanes, saved bits, refusals ------------------------


@pytest.mark.parametrize(
    "dtype,lanes",
    [(torch.float32, 16), (torch.bfloat16, 16), (torch.float16, 16), (torch.float32, 8)],
)
def test_decode_equals_prefill_long_rows(dtype, lanes):
    """Queries with up to 300 keys (key counts on and off lane multiples): decode of every
    sampled prefix == the same row of the whole prefill, and chunked prefill cut anywhere ==
    the whole, with 1 and 2 threads."""
    t = 300
    q, k, v = _qkv(t, dtype, seed=11)
    kw = {"scale": SCALE, "lanes": lanes}
    full = attention_varlen(q, k, v, torch.tensor([0, t]), **kw)
    kc, vc, perm = _paged(k, v, block_size=16, num_blocks=-(-t // 16) + 2, seed=12)
    ns = sorted({1, 2, 15, 16, 17, 64, 65, 127, 128, 129, 256, 257, t})
    for nt in (1, 2):
        with num_threads(nt):
            for n in ns:
                got = attention_paged(
                    q[n - 1 : n], kc, vc, perm[None], torch.tensor([n]), torch.tensor([0, 1]), **kw
                )
                assert torch.equal(got[0], full[n - 1]), (nt, n)
            for split in (37, 133, 200):
                outs = [
                    attention_paged(
                        q[s:e],
                        kc,
                        vc,
                        perm[None],
                        torch.tensor([e]),
                        torch.tensor([0, e - s]),
                        **kw,
                    )
                    for s, e in ((0, split), (split, t))
                ]
                assert torch.equal(torch.cat(outs), full), (nt, split)


def test_lanes_is_a_real_parameter():
    """The contract records `lanes`: another lane count is another reduction order and must
    give other bits (what makes a site declared with lanes=8 a real mismatch)."""
    q, k, v = _qkv(200, seed=21)
    cu = torch.tensor([0, 200])
    a = attention_varlen(q, k, v, cu, scale=SCALE, lanes=16)
    b = attention_varlen(q, k, v, cu, scale=SCALE, lanes=8)
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 1e-5
    with pytest.raises(ValueError, match="lanes=4"):
        attention_varlen(q, k, v, cu, scale=SCALE, lanes=4)


# sha256 of the kernel's output on fixed inputs, at version 4. The bits are defined by the
# source alone (explicit lanes, no FMA contraction, no reassociation, our own exp), so they
# are the same on every CPU this runs on (CI draws Intel and AMD machines). A change here
# means the op's bits changed: bump its version in ops/__init__.py and record the new hash.
SAVED_V4 = {
    torch.float32: "f5f915f18ea84228",
    torch.bfloat16: "7f348b1ee9fa6dca",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bits_v4(dtype):
    import hashlib

    from isoexec.ops import REGISTRY

    assert REGISTRY["attention"].version == 4
    q, k, v = _qkv(97, dtype, seed=41)
    out = attention_varlen(q, k, v, torch.tensor([0, 30, 97]), scale=SCALE)
    digest = hashlib.sha256(out.float().numpy().tobytes()).hexdigest()[:16]
    assert digest == SAVED_V4[dtype]


def test_refuses_what_it_cannot_run():
    q, k, v = _qkv(4)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="compiled CPU kernel"):
        attention_varlen(q.to("meta"), k.to("meta"), v.to("meta"), cu, scale=SCALE)
    with pytest.raises(ValueError, match="dtype"):
        attention_varlen(q.double(), k.double(), v.double(), cu, scale=SCALE)


def test_negative_control_split_kv_depends_on_where_it_splits():
    """Why p·v is cut into fixed chunks: a schedule that splits the keys where the key count
    says (split-KV decoding, or a BLAS blocking K by size) rounds each split's partial before
    summing, so a row's bits change with the split point.

    The split is built in, at key 499 of 1000. A BLAS blocks K in fixed sizes that are
    multiples of its unroll, or in equal parts (measured: MKL on AMD EPYC cut K <= 256 into two
    equal halves); no such blocking ends a block at 499, so the two-GEMM schedule rounds where
    the one GEMM does not, on any CPU and library.
    """
    g = torch.Generator().manual_seed(14)
    p = torch.rand(1, 64, 1000, generator=g)
    v = torch.randn(1, 1000, 64, generator=g)
    whole = torch.bmm(p, v)
    split = torch.bmm(p[..., :499], v[:, :499]) + torch.bmm(p[..., 499:], v[:, 499:])
    assert not torch.equal(whole, split)


def test_accuracy_vs_float64_long():
    q, k, v = _qkv(300, seed=15)
    out = attention_varlen(q, k, v, torch.tensor([0, 300]), scale=SCALE).double()
    assert (out - _ref64(q, k, v)).abs().max() < 1e-5


def _decode_step_inputs(lens, qlens, bs=8, seed=11):
    """A paged batch of requests with context lengths `lens`, the last `qlens` tokens new."""
    g = torch.Generator().manual_seed(seed)
    nblk = sum(-(-n // bs) for n in lens) + 3
    kc = torch.randn(nblk, bs, HKV, D, generator=g)
    vc = torch.randn(nblk, bs, HKV, D, generator=g)
    perm = torch.randperm(nblk, generator=g)
    width = max(-(-n // bs) for n in lens) + 2
    bt = torch.full((len(lens), width), 10**6, dtype=torch.int32)  # unused columns: garbage
    used = 0
    for r, n in enumerate(lens):
        nb = -(-n // bs)
        bt[r, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(sum(qlens), H, D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    return q, kc, vc, bt, torch.tensor(lens), qsl


def test_paged_step_equals_each_request_alone():
    """One call over many requests (decode, prefill chunk, an empty request) gives each request
    the bits it gets alone."""
    lens, qlens = [5, 130, 1, 300, 64, 9, 257], [1, 1, 1, 20, 0, 9, 1]
    q, kc, vc, bt, sl, qsl = _decode_step_inputs(lens, qlens)
    whole = attention_paged(q, kc, vc, bt, sl, qsl, scale=SCALE)
    for r in range(len(lens)):
        s, e = int(qsl[r]), int(qsl[r + 1])
        if e == s:
            continue
        alone = attention_paged(
            q[s:e], kc, vc, bt[r : r + 1], sl[r : r + 1], torch.tensor([0, e - s]), scale=SCALE
        )
        assert torch.equal(alone, whole[s:e]), r


def test_attention_never_touches_the_thread_count(monkeypatch):
    """vLLM's CPU worker replaces torch.set_num_threads with a warning stub after binding its
    threads (an earlier attention switched to one thread per call: two warnings each, thousands
    per generate); the attention must not call it, and its bits must not depend on it."""
    q, kc, vc, bt, sl, qsl = _decode_step_inputs([40, 7], [1, 1])
    ref = attention_paged(q, kc, vc, bt, sl, qsl, scale=SCALE)
    calls: list[int] = []
    real, old = torch.set_num_threads, torch.get_num_threads()
    real(2)  # more than one thread: the guard, not the 1-thread shortcut, must skip the call
    try:
        monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
        got = attention_paged(q, kc, vc, bt, sl, qsl, scale=SCALE)
    finally:
        monkeypatch.undo()
        real(old)
    assert calls == [] and torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_block_size_same_bits(dtype):
    """The cache block size is not part of the bits: vLLM-CPU's 128-key blocks give the bits of
    8-key blocks, for decode rows and a prefill chunk side by side (NaN garbage in unused
    slots is never read)."""
    lens, qlens = [130, 5, 300, 129], [1, 1, 17, 1]
    q, kc8, vc8, bt8, sl, qsl = _decode_step_inputs(lens, qlens, bs=8, seed=31)
    q, kc8, vc8 = q.to(dtype), kc8.to(dtype), vc8.to(dtype)
    ref = attention_paged(q, kc8, vc8, bt8, sl, qsl, scale=SCALE)
    bs = 128  # the same keys/values, re-blocked: request r owns blocks 3r.. in order
    kc = torch.full((3 * len(lens) + 1, bs, HKV, D), float("nan"), dtype=dtype)  # garbage
    vc = torch.full_like(kc, float("nan"))
    bt = torch.zeros(len(lens), 3, dtype=torch.int32)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        slots8 = bt8[r, pos // 8].long() * 8 + pos % 8
        for j in range(-(-n // bs)):
            bt[r, j] = 3 * r + j + 1
        slots = bt[r, pos // bs].long() * bs + pos % bs
        kc.view(-1, HKV, D)[slots] = kc8.view(-1, HKV, D)[slots8]
        vc.view(-1, HKV, D)[slots] = vc8.view(-1, HKV, D)[slots8]
    got = attention_paged(q, kc, vc, bt, sl, qsl, scale=SCALE)
    assert torch.equal(got, ref)
    assert not got.isnan().any()


def test_strided_inputs_read_in_place_same_bits():
    """q/k/v as column slices of one wider projection (what a fused QKV or a gated q gives):
    the kernel reads them through their strides, with the bits of contiguous copies."""
    t = 40
    g = torch.Generator().manual_seed(51)
    wide = torch.randn(t, (H + 2 * HKV) * D + 7, generator=g)
    q = wide[:, : H * D].view(t, H, D)
    k = wide[:, H * D : (H + HKV) * D].view(t, HKV, D)
    v = wide[:, (H + HKV) * D : (H + 2 * HKV) * D].view(t, HKV, D)
    assert not k.is_contiguous() and not v.is_contiguous()
    cu = torch.tensor([0, 17, t])
    got = attention_varlen(q, k, v, cu, scale=SCALE)
    want = attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, scale=SCALE)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_queries_and_out_keep_the_bits(dtype):
    """What an engine does per step (#37): the query positions computed once and handed to
    every layer, and the result written into the caller's buffer, give the bits of the plain
    call; rows past the real queries (vLLM's padding) are zeroed, as the plain call returns."""
    from isoexec.ops import paged_queries

    lens, qlens = [130, 5, 300, 1, 64], [1, 1, 17, 1, 0]
    q, kc, vc, bt, sl, qsl = _decode_step_inputs(lens, qlens, seed=61)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    padded = torch.cat([q, torch.randn(3, H, D).to(dtype)])  # 3 padding rows past qsl[-1]
    ref = attention_paged(padded, kc, vc, bt, sl, qsl, scale=SCALE)
    assert torch.equal(ref[-3:], torch.zeros_like(ref[-3:]))
    step = paged_queries(bt, sl, qsl)
    assert step.count == sum(qlens)
    for layer in range(2):  # the same step object for two layers' calls
        out = torch.full_like(ref, float("nan"))
        got = attention_paged(
            padded, kc, vc, bt[:0], sl[:0], qsl[:1], scale=SCALE, queries=step, out=out
        )  # the tensors are not read when `queries` is given: emptied here to show it
        assert got is out and torch.equal(out, ref), layer
    # negative control: another step's queries (positions shifted by one) change the rows
    other = paged_queries(bt, sl - 1, qsl)
    moved = attention_paged(padded, kc, vc, bt, sl, qsl, scale=SCALE, queries=other)
    assert not torch.equal(moved[: step.count], ref[: step.count])


def test_out_must_have_the_result_shape():
    q, kc, vc, bt, sl, qsl = _decode_step_inputs([40, 7], [1, 1])
    with pytest.raises(ValueError, match="out is"):
        attention_paged(q, kc, vc, bt, sl, qsl, scale=SCALE, out=torch.empty(2, H, D + 1))


def test_out_of_another_dtype_holds_the_result_rounded_to_the_queries_dtype():
    """bf16 queries: the result is bf16 whatever `out` stores, as the plain call returns it."""
    q, kc, vc, bt, sl, qsl = _decode_step_inputs([40, 7], [1, 1], seed=71)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    ref = attention_paged(q, kc, vc, bt, sl, qsl, scale=SCALE)
    out = torch.empty(ref.shape, dtype=torch.float32)
    attention_paged(q, kc, vc, bt, sl, qsl, scale=SCALE, out=out)
    assert torch.equal(out, ref.float())
