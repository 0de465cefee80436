"""MoE: router ties and renormalisation, a token's output independent of which other tokens
share its experts (and of threads), accuracy, backward; native F.linear experts and v1's
32-row oneDNN blocks differ in fp32; the grouped GEMM kernel's bits are its source's; bf16
experts run on AMX tiles where the CPU has them (v5), else (and fp16) the canonical linear's
blocks (v4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import assert_grads_match_float64, assert_row_invariant, assert_row_variant

from isoexec.ops import moe_combine, moe_experts, moe_router, moe_weighted_sum

E, TOPK, HID, INTER = 8, 2, 256, 96


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, HID, generator=g) * HID**-0.5).to(dtype)
    w2 = (torch.randn(E, HID, INTER, generator=g) * INTER**-0.5).to(dtype)
    wr = torch.randn(E, HID, generator=g).to(dtype)
    sh13 = (torch.randn(2 * INTER, HID, generator=g) * HID**-0.5).to(dtype)
    sh2 = (torch.randn(HID, INTER, generator=g) * INTER**-0.5).to(dtype)
    shg = torch.randn(1, HID, generator=g).to(dtype)
    return w13, w2, wr, sh13, sh2, shg


def _block(dtype, shared=True):
    w13, w2, wr, sh13, sh2, shg = _weights(dtype)

    def fn(x):
        w, ids = moe_router(x.float() @ wr.float().T, TOPK, renormalize=True)
        kw = dict(shared_w13=sh13, shared_w2=sh2, shared_gate_w=shg) if shared else {}
        return moe_combine(x, w, ids, w13, w2, **kw)

    return fn


def _gen(dtype):
    def gen(m, g):
        return (torch.randn(m, HID, generator=g).to(dtype),)

    return gen


def test_router_ties_go_to_lower_index_and_renormalise():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    w, ids = moe_router(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(w, torch.softmax(logits, -1).gather(-1, ids))
    w, _ = moe_router(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(2)) and w.dtype == torch.float32
    assert_row_invariant(
        lambda x: torch.cat([t.float() for t in moe_router(x, 3, renormalize=True)], -1),
        lambda m, g: (torch.randn(m, 60, generator=g),),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_independent_of_other_tokens(dtype):
    """Batches of 1..300 tokens routed to overlapping experts (8 experts, top-2: every expert
    shares tokens; 300 tokens = 600 slots also take the kernel's wide-tile schedule), the row
    in the middle and last, 1 and 2 threads."""
    assert_row_invariant(_block(dtype), _gen(dtype), sizes=(1, 2, 7, 33, 300))


def test_negative_control_native_experts_differ():
    """HF-style experts (F.linear over each expert's gathered tokens) depend on how many
    tokens the expert got."""
    w13, w2, wr, *_ = _weights(torch.float32)

    def naive(x):
        w, ids = moe_router(x @ wr.T, TOPK, renormalize=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            h = F.linear(x[tok], w13[e])
            y = F.linear(F.silu(h[:, :INTER]) * h[:, INTER:], w2[e])
            out = out.index_add(0, tok, y * w[tok, slot, None])
        return out

    assert_row_variant(naive, _gen(torch.float32), sizes=(1, 2, 7, 16, 64))


def test_weighted_sum_is_ascending_expert_order():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 2, 8, generator=g)
    w = torch.rand(3, 2, generator=g)
    ids = torch.tensor([[5, 1], [0, 3], [7, 2]])
    got = moe_weighted_sum(y, w, ids)
    swapped = moe_weighted_sum(y.flip(1), w.flip(1), ids.flip(1))
    assert torch.equal(got, swapped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_vs_float64(dtype):
    w13, w2, wr, sh13, sh2, shg = _weights(dtype)
    x = torch.randn(20, HID, generator=torch.Generator().manual_seed(2)).to(dtype)
    w, ids = moe_router(x.float() @ wr.float().T, TOPK, renormalize=True)
    got = moe_combine(x, w, ids, w13, w2, shared_w13=sh13, shared_w2=sh2, shared_gate_w=shg)
    xd = x.double()

    def mlp(a, b, c):
        h = a @ b.double().T
        return (F.silu(h[:, :INTER]) * h[:, INTER:]) @ c.double().T

    ref = torch.sigmoid(xd @ shg.double().T) * mlp(xd, sh13, sh2)
    for t in range(20):
        for j in range(TOPK):
            e = int(ids[t, j])
            ref[t] += w[t, j].double() * mlp(xd[t : t + 1], w13[e], w2[e])[0]
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert (got.double() - ref).abs().max() < tol


def test_backward_matches_float64():
    w13, w2, wr, *_ = _weights(torch.float32)
    x = torch.randn(6, HID, generator=torch.Generator().manual_seed(3))
    w, ids = moe_router(x @ wr.T, TOPK, renormalize=True)

    def ref(x, w13, w2):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(TOPK):
                e = int(ids[t, j])
                h = x[t] @ w13[e].T
                out[t] = out[t] + w[t, j].double() * ((F.silu(h[:INTER]) * h[INTER:]) @ w2[e].T)
        return out

    assert_grads_match_float64(lambda x, a, b: moe_combine(x, w, ids, a, b), ref, (x, w13, w2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_split_outputs_reassemble_exactly(dtype):
    """Expert parallelism's exchange: each half of the experts fills its slots and leaves -0.0
    elsewhere; the halves' sum (either order) is the whole-expert output bit for bit, signed
    zeros included, and `moe_combine(expert_out=...)` on it equals `moe_combine`."""
    from isoexec.ops import moe_experts

    w13, w2, wr, sh13, sh2, shg = _weights(dtype)
    x = torch.randn(37, HID, generator=torch.Generator().manual_seed(3)).to(dtype)
    w, ids = moe_router(x.float() @ wr.float().T, TOPK, renormalize=True)
    whole = moe_experts(x, ids, w13, w2)
    lo = moe_experts(x, ids, w13[: E // 2], w2[: E // 2], first_expert=0)
    hi = moe_experts(x, ids, w13[E // 2 :], w2[E // 2 :], first_expert=E // 2)
    for total in (lo + hi, hi + lo):
        assert torch.equal(total, whole)
        assert torch.equal(torch.signbit(total), torch.signbit(whole))
    assert torch.equal(
        torch.signbit(lo[ids >= E // 2]), torch.ones_like(lo[ids >= E // 2], dtype=torch.bool)
    )
    kw = dict(shared_w13=sh13, shared_w2=sh2, shared_gate_w=shg)
    assert torch.equal(
        moe_combine(x, w, ids, w13, w2, expert_out=lo + hi, **kw),
        moe_combine(x, w, ids, w13, w2, **kw),
    )
    # A slot whose expert output is +0.0 keeps it: -0.0 + 0.0 is +0.0, not -0.0.
    assert torch.equal(torch.signbit(torch.tensor(-0.0) + torch.tensor(0.0)), torch.tensor(False))


def _routed(dtype, t, seed):
    w13, w2, wr, sh13, sh2, shg = _weights(dtype)
    x = torch.randn(t, HID, generator=torch.Generator().manual_seed(seed)).to(dtype)
    w, ids = moe_router(x.float() @ wr.float().T, TOPK, renormalize=True)
    return x, w, ids, w13, w2, dict(shared_w13=sh13, shared_w2=sh2, shared_gate_w=shg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_one_and_two_give_the_same_batch(dtype):
    """The kernel hands (expert, row tile, column tile) items to torch's thread count; each
    element is computed whole by one thread, so the whole batch is the same bits."""
    from tests._support.threads import num_threads

    x, w, ids, w13, w2, kw = _routed(dtype, 300, seed=5)
    outs = []
    for nt in (1, 2):
        with num_threads(nt):
            outs.append(moe_combine(x, w, ids, w13, w2, **kw))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [HID, 100, 7])
def test_grouped_gemm_rows_alone_and_accuracy(dtype, k):
    """The kernel itself: every row of every group equals that row run alone (edge blocks of
    1..3 rows and columns, a K tail past the last 16-lane chunk), within fp32 accuracy of a
    float64 reference, for each input dtype."""
    from isoexec.ops import moe

    g = torch.Generator().manual_seed(6)
    # groups of 1 and 2 rows (4-row blocks), 5 and 14 (one block of the group's rows: 2 and
    # 1 weight rows wide), 39 (4 x 4 blocks and an edge)
    n, offsets = 37, torch.tensor([0, 1, 6, 20, 59, 61])
    wsel = torch.tensor([3, 0, 1, 2, 1])
    x = torch.randn(61, k, generator=g).to(dtype)
    w = (torch.randn(4, n, k, generator=g) * k**-0.5).to(dtype)
    y = moe._grouped_gemm(x, w, offsets, wsel, moe.DEFAULT_LANES)
    for grp, e in enumerate(wsel.tolist()):
        a, b = int(offsets[grp]), int(offsets[grp + 1])
        ref = x[a:b].double() @ w[e].double().T
        assert (y[a:b].double() - ref).abs().max() < 1e-5
        for r in range(a, b):
            one = (torch.tensor([0, 1]), torch.tensor([0]))
            alone = moe._grouped_gemm(x[r : r + 1], w[e : e + 1], *one, moe.DEFAULT_LANES)
            assert torch.equal(alone[0], y[r]), (grp, r)


def _written_order(x: torch.Tensor, w: torch.Tensor, lanes: int) -> torch.Tensor:
    """moe.cpp's definition spelled out in torch: lane l accumulates x[m, k] * w[n, k] for
    k = l, l + lanes, .. in order, then the lanes meet in simd.h's pairwise tree. For bf16 and
    fp16 inputs the fp32 product is exact, so the kernel's fused multiply-add equals torch's
    product-then-add here."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0], lanes)
    for k in range(x.shape[1]):
        acc[:, :, k % lanes] = acc[:, :, k % lanes] + xf[:, k, None] * wf[None, :, k]
    width = lanes // 2
    while width >= 1:
        acc[:, :, :width] = acc[:, :, :width] + acc[:, :, width : 2 * width]
        width //= 2
    return acc[:, :, 0]


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_gemm_is_its_written_order(dtype, lanes):
    """The kernel's bits are the order its header writes down, for every register block it
    picks: groups of 1..17 rows (4-row blocks, one block of the group's rows 2 or 1 weight
    rows wide, 4 x 4 blocks past 16) and 39, 37 output columns (edge blocks), a K tail."""
    from isoexec.ops import moe

    g = torch.Generator().manual_seed(12)
    sizes = [*range(1, 18), 39]
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    wsel = torch.arange(len(sizes)) % 3
    x = torch.randn(int(offsets[-1]), 100, generator=g).to(dtype)
    w = (torch.randn(3, 37, 100, generator=g) * 0.1).to(dtype)
    y = moe._grouped_gemm(x, w, offsets, wsel, lanes)
    for grp, e in enumerate(wsel.tolist()):
        a, b = int(offsets[grp]), int(offsets[grp + 1])
        assert torch.equal(y[a:b], _written_order(x[a:b], w[e], lanes)), sizes[grp]


def test_negative_control_v1_onednn_blocks_differ():
    """Experts through the canonical linear (v1 ran them so, in 32-row oneDNN blocks; now the
    linear's one chain per output) give other bits than the grouped kernel's lanes: the fixed
    order is a real choice, so a side on another expert GEMM must not MATCH."""
    from isoexec.ops import linear, moe, silu_mul

    x, _w, ids, w13, w2, _ = _routed(torch.float32, 40, seed=7)
    v1 = torch.zeros(ids.shape[0], ids.shape[1], w2.shape[1])
    for e in torch.unique(ids).tolist():  # per expert, ascending, through the linear
        tok, slot = (ids == e).nonzero(as_tuple=True)
        v1[tok, slot] = linear(silu_mul(linear(x[tok], w13[e])), w2[e])
    v2 = moe.moe_experts(x, ids, w13, w2)
    assert not torch.equal(v1, v2)
    assert (v1 - v2).abs().max() < 1e-5


def test_lanes_is_a_real_parameter():
    """Another lane count is another reduction order: other bits, same accuracy."""
    from isoexec.ops import moe

    x, w, ids, w13, w2, kw = _routed(torch.float32, 20, seed=8)
    a = moe_combine(x, w, ids, w13, w2, lanes=16, **kw)
    b = moe_combine(x, w, ids, w13, w2, lanes=8, **kw)
    assert not torch.equal(a, b) and (a - b).abs().max() < 1e-5
    with pytest.raises(ValueError, match="lanes=4"):
        moe.moe_experts(x, ids, w13, w2, lanes=4)


def test_backward_with_shared_expert_and_slot_inputs_matches_float64():
    """The trainer's shape: per-slot inputs [T, k, H] (each slot's gradient its own) into
    `moe_experts`, then the combine with the shared expert; fp32 gradients of every input
    (slots, routed and shared weights, gate) against float64."""
    from isoexec.ops import moe_experts

    x, w, ids, w13, w2, kw = _routed(torch.float32, 6, seed=9)
    slots = x[:, None].expand(-1, TOPK, -1).contiguous()

    def fn(xs, x, a, b, s13, s2, sg):
        y = moe_experts(xs, ids, a, b)
        return moe_combine(
            x, w, ids, a, b, expert_out=y, shared_w13=s13, shared_w2=s2, shared_gate_w=sg
        )

    def ref(xs, x, a, b, s13, s2, sg):
        def mlp(v, p, q):
            h = v @ p.T
            return (F.silu(h[..., :INTER]) * h[..., INTER:]) @ q.T

        out = torch.sigmoid(x @ sg.T) * mlp(x, s13, s2)
        for t in range(x.shape[0]):
            for j in range(TOPK):
                e = int(ids[t, j])
                out[t] = out[t] + w[t, j].double() * mlp(xs[t, j], a[e], b[e])
        return out

    inputs = (slots, x, w13, w2, kw["shared_w13"], kw["shared_w2"], kw["shared_gate_w"])
    assert_grads_match_float64(fn, ref, inputs)


def test_registry_v5_records_which_expert_gemm_runs(monkeypatch):
    """moe_combine v5 records the grouped kernel and its lanes in fp32 (no GEMM library: no
    `_block_gemm` runs); in bf16 the AMX tile kernel and its k chunk where the CPU has
    AMX-BF16, else (and in fp16) the linear's blocks with their library, exactly as a linear
    site in that dtype records it; its fingerprint changes when moe.cpp's text does, another
    op's does not."""
    from isoexec.ops import (
        GEMM_DTYPES,
        REGISTRY,
        cpu_kernels,
        depends_on_placement,
        get_impl,
        moe,
    )
    from isoexec.ops.gemm import gemm_library

    info = REGISTRY["moe_combine"]
    assert info.version == 6 and "moe_combine" not in GEMM_DTYPES
    assert depends_on_placement("moe_combine") and not depends_on_placement("rms_norm")
    params = info.param_dict()
    assert params["kernel"] == moe.GROUPED and params["lanes"] == "16"
    assert "block_rows" not in params and "gemm" not in params
    assert get_impl("moe_combine", device="cpu", dtype=torch.float32) == info
    for amx in (True, False):
        monkeypatch.setattr(moe, "amx_available", lambda amx=amx: amx)
        p = get_impl("moe_combine", device="cpu", dtype=torch.bfloat16).param_dict()
        if amx:
            assert p["kernel"] == moe.AMX_TILES and p["k_chunk"] == "32", p
            assert "gemm" not in p and "block_rows" not in p
        for dtype in (torch.bfloat16, torch.float16) if not amx else (torch.float16,):
            p = get_impl("moe_combine", device="cpu", dtype=dtype).param_dict()
            assert p["kernel"] == moe.LINEAR_BLOCKS and p["block_rows"] == "32", dtype
            assert p["gemm"] == gemm_library("cpu", dtype)
            lin = get_impl("linear", device="cpu", dtype=dtype).param_dict()
            assert p["gemm"] == lin["gemm"]
    assert moe.KERNEL_LIBRARIES == ("moe",) and "moe.cpp" in cpu_kernels.SOURCES["moe"]
    real = cpu_kernels.source_text
    monkeypatch.setattr(
        cpu_kernels, "source_text", lambda n: real(n) + ("// edit" if n == "moe" else "")
    )
    assert get_impl("moe_combine").source_fingerprint != info.source_fingerprint
    assert get_impl("rms_norm").source_fingerprint == REGISTRY["rms_norm"].source_fingerprint


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_fp16_experts_are_the_canonical_linear_per_expert(dtype, monkeypatch):
    """Without AMX (bf16) and in fp16, every expert's rows (and the shared expert's, all
    tokens) go through the canonical `linear` with that expert's weight: the block GEMM and
    bits a linear site runs. (On an AMX CPU the test turns AMX off: the path runs wherever
    the CPU has none.) Negative control: the grouped kernel (the fp32 path, which also takes
    these dtypes) gives other bits on the same inputs, so which GEMM runs is a real, recorded
    choice."""
    from isoexec.ops import linear, moe, silu_mul

    monkeypatch.setattr(moe, "amx_available", lambda: False)

    x, w, ids, w13, w2, kw = _routed(dtype, 45, seed=11)
    want = torch.empty(ids.shape[0], ids.shape[1], w2.shape[1], dtype=dtype)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        want[tok, slot] = linear(silu_mul(linear(x[tok], w13[e])), w2[e])
    got = moe.moe_experts(x, ids, w13, w2)
    assert torch.equal(got, want)
    shared = linear(silu_mul(linear(x, kw["shared_w13"])), kw["shared_w2"])
    gate = linear(x, kw["shared_gate_w"])
    combined = moe.moe_weighted_sum(want, w, ids, shared_out=shared, shared_gate=gate)
    assert torch.equal(moe_combine(x, w, ids, w13, w2, **kw), combined)
    # Rounded to 8 (bf16) or 11 (fp16) bits, two fp32 orders agree on most elements: compare
    # 64k outputs of 4096-term sums (bf16: ~12 straddle a rounding boundary, fp16 ~250).
    g = torch.Generator().manual_seed(12)
    rows = torch.randn(128, 4096, generator=g).to(dtype)
    wk = (torch.randn(2, 512, 4096, generator=g) * 4096**-0.5).to(dtype)
    offsets, wsel = torch.tensor([0, 128]), torch.tensor([1])
    kernel = moe._grouped_gemm(rows, wk, offsets, wsel, moe.DEFAULT_LANES).to(dtype)
    blocks = moe._forward(rows, wk, offsets, wsel, moe.DEFAULT_LANES)
    assert torch.equal(blocks, linear(rows, wk[1])) and not torch.equal(kernel, blocks)
    assert (kernel.float() - blocks.float()).abs().max() < 0.05


# sha256 of the grouped GEMM's output on fixed inputs (moe_combine's fp32 experts since v3;
# in bf16 the kernel alone, which moe_combine no longer runs there since v4). The bits
# are defined by the kernel's source alone (explicit lanes, one fused multiply-add per
# product, no other contraction, no reassociation), so they are the same on every CPU this
# runs on (CI draws Intel and AMD machines). (The silu/sigmoid around it are torch's
# position-invariant `_pointwise` ops.) A change here means the op's bits changed: bump its
# version in ops/__init__.py and record the new hash. v3 changed fp32 only (v2 rounded each
# fp32 product before adding it; bf16/fp16 products are exact, so their v2 bits stand).
SAVED_V3 = {
    torch.float32: "2e08c9a3f7f3a237",  # v2: "338f03e64148437f"
    torch.bfloat16: "c0779e4a10d8eceb",  # = v2
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bits_v3(dtype):
    import hashlib

    from isoexec.ops import REGISTRY, moe

    assert REGISTRY["moe_combine"].version == 6  # v4 to v6 kept the grouped kernel's bits
    g = torch.Generator().manual_seed(10)
    x = torch.randn(45, 100, generator=g).to(dtype)
    w = (torch.randn(3, 37, 100, generator=g) * 0.1).to(dtype)
    offsets, wsel = torch.tensor([0, 2, 9, 45]), torch.tensor([2, 0, 1])
    out = moe._grouped_gemm(x, w, offsets, wsel, moe.DEFAULT_LANES)
    digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]
    assert digest == SAVED_V3[dtype], digest


def test_refuses_other_devices():
    """The torch backend's experts are the compiled CPU kernel: a meta (or CUDA) tensor is an
    error, not a silent fallback to another GEMM (the Triton backend has its own MoE)."""
    x = torch.randn(3, 16, device="meta")
    ids = torch.zeros(3, 2, dtype=torch.int64, device="meta")
    w13, w2 = torch.randn(2, 8, 16, device="meta"), torch.randn(2, 16, 4, device="meta")
    with pytest.raises(ValueError, match="compiled CPU kernel"):
        moe_experts(x, ids, w13, w2)
