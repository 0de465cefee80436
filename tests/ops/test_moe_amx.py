"""moe_combine v5's bf16 experts on AMX tiles (`moe._amx_groups`): a row's bits depend on that
row and its expert alone (group sizes, tile padding, K and N tails, threads), accuracy against
float64, the bits are pinned, the engine's packed weight follows in-place updates, and the
other expert GEMM orders give other bits (negative control). The kernel tests skip, with the
reason, on a CPU without AMX-BF16 (CI draws Intel machines, which have it, and AMD ones, which
run the linear's blocks instead: tests/ops/test_moe.py); the refusals run everywhere."""

from __future__ import annotations

import hashlib

import pytest
import torch

from isoexec.ops import gemm, moe

needs_amx = pytest.mark.skipif(
    not moe.amx_available(),
    reason="the AMX expert kernel needs a CPU with AMX-BF16 (and Linux's AMX tile state)",
)


def _groups(sizes: list[int], experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(sizes), 0, out=offsets[1:])
    return offsets, torch.tensor(experts, dtype=torch.int64)


def _inputs(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(3, n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    return x, w


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(768, 768), (37, 100), (130, 7), (64, 33)])
def test_rows_alone_and_in_any_group_and_accuracy(n, k):
    """Groups of 1, 15, 16, 17, 33 rows (one tile, a full one, one over, several) and an
    empty one, K and N off the 32-k chunk and 64-column quad: every row equals the same row
    computed alone, and the result is within fp32 accumulation error of float64."""
    sizes, experts = [1, 15, 16, 0, 17, 33, 5], [2, 0, 1, 2, 2, 0, 1]
    x, w = _inputs(sum(sizes), n, k, seed=n + k)
    offsets, wsel = _groups(sizes, experts)
    y = moe._amx_groups(x, w, offsets, wsel)
    assert y.dtype == torch.float32 and y.shape == (sum(sizes), n)
    one = torch.tensor([0, 1])
    for g, e in enumerate(experts):
        a, b = int(offsets[g]), int(offsets[g + 1])
        ref = x[a:b].double() @ w[e].double().T
        assert torch.allclose(y[a:b].double(), ref, rtol=0, atol=1e-4)
        for r in range(a, b):
            alone = moe._amx_groups(x[r : r + 1], w, one, torch.tensor([e]))
            assert torch.equal(alone[0], y[r]), (g, r)


@needs_amx
def test_strided_operands_give_the_same_bits():
    """x rows with a row stride wider than K (a slice of a wider buffer) and a weight that is
    a transposed view (packed from a copy): the kernel reads strides, the bits stay."""
    x, w = _inputs(40, 96, 160, seed=6)
    offsets, wsel = _groups([7, 33], [2, 1])
    want = moe._amx_groups(x, w, offsets, wsel)
    wide = torch.zeros(40, 200, dtype=torch.bfloat16)
    wide[:, 17:177] = x
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, k not contiguous
    assert not w_t.is_contiguous()
    assert torch.equal(moe._amx_groups(wide[:, 17:177], w_t, offsets, wsel), want)


@needs_amx
def test_threads_one_and_two_give_the_same_bits():
    """A prefill-sized batch (several tiles per group, every quad an item) with 1 and 2
    threads: the items a thread takes never change a bit."""
    x, w = _inputs(300, 768, 384, seed=3)
    offsets, wsel = _groups([120, 0, 97, 83], [1, 0, 2, 0])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe._amx_groups(x, w, offsets, wsel)
        torch.set_num_threads(2)
        two = moe._amx_groups(x, w, offsets, wsel)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


# sha256 of the kernel's fp32 output on fixed inputs. The bits are the AMX instruction's
# (TDPBF16PS per 32-k chunk, chunks ascending): the same on every AMX-BF16 CPU. A change here
# means the op's bits changed: bump moe_combine's version in ops/__init__.py and record it.
SAVED_V5 = "6bbcef905b1fd8cf"


@needs_amx
def test_saved_bits_v5():
    from isoexec.ops import REGISTRY

    assert REGISTRY["moe_combine"].version == 6  # v6 changed the linear blocks only
    x, w = _inputs(45, 37, 100, seed=10)
    offsets, wsel = _groups([2, 7, 36], [2, 0, 1])
    out = moe._amx_groups(x, w, offsets, wsel)
    digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]
    assert digest == SAVED_V5, digest


@needs_amx
def test_negative_control_other_orders_differ():
    """The grouped kernel's order (16 fp32 lanes of fused multiply-adds and a tree) and a
    split-K order (two halves from zero, then added: what a K-parallel GEMM does) give other
    bits on the same inputs, rounded to bf16 as the experts are: the chunk order is a real,
    recorded choice. Same accuracy."""
    x, w = _inputs(128, 512, 4096, seed=12)
    offsets, wsel = _groups([128], [1])
    amx = moe._amx_groups(x, w, offsets, wsel).to(torch.bfloat16)
    grouped = moe._grouped_gemm(x, w, offsets, wsel, moe.DEFAULT_LANES).to(torch.bfloat16)
    halves = [moe._amx_groups(x[:, h].contiguous(), w[:, :, h].contiguous(), offsets, wsel)
              for h in (slice(0, 2048), slice(2048, 4096))]  # fmt: skip
    split = (halves[0] + halves[1]).to(torch.bfloat16)
    for other in (grouped, split):
        assert not torch.equal(amx, other)
        assert (amx.float() - other.float()).abs().max() < 0.05


@needs_amx
def test_bf16_experts_run_the_amx_kernel(monkeypatch):
    """`moe_experts` in bf16 runs `_amx_groups` (each projection rounded to bf16, silu·up
    between) and never the linear's blocks: its output is the kernel's, composed by hand, and
    the calls are counted (on this CPU the blocks often give the same bits, so equal outputs
    alone would not tell the two apart)."""
    from isoexec.ops import silu_mul

    g = torch.Generator().manual_seed(5)
    x = torch.randn(19, 96, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(4, 2 * 40, 96, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(4, 96, 40, generator=g) * 0.15).to(torch.bfloat16)
    ids = torch.randint(0, 4, (19, 2), generator=g)
    assert moe.expert_gemm(torch.bfloat16) == moe.AMX_TILES
    calls: list[str] = []
    amx, blocks = moe._amx_groups, moe._block_groups
    monkeypatch.setattr(moe, "_amx_groups", lambda *a: calls.append("amx") or amx(*a))
    monkeypatch.setattr(moe, "_block_groups", lambda *a: calls.append("blocks") or blocks(*a))
    got = moe.moe_experts(x, ids, w13, w2)
    assert calls == ["amx", "amx"]  # one call per projection, every group in it
    want = torch.empty_like(got)
    for e in range(4):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            one = _groups([tok.numel()], [e])
            h = silu_mul(amx(x[tok], w13, *one).to(torch.bfloat16))
            want[tok, slot] = amx(h, w2, *one).to(torch.bfloat16)
    assert torch.equal(got, want)


@needs_amx
def test_engine_packed_weight_is_cached_and_follows_in_place_updates():
    """With the engine's packed-weight cache on, a parameter is packed once, an in-place
    update repacks (doubling a bf16 weight doubles every output exactly), and a `.data` write
    (vLLM's loaders) is seen after the owner's `clear_packed_weight_cache()`, as for the
    linear's packs: one cache, one protocol."""
    x, w = _inputs(20, 64, 96, seed=4)
    param = torch.nn.Parameter(w.clone(), requires_grad=False)
    offsets, wsel = _groups([20], [1])
    gemm.enable_packed_weight_cache()
    try:
        y1 = moe._amx_groups(x, param, offsets, wsel)
        keys = [k for k in gemm._PACK_CACHE if k[-1] == "amx-tiles"]
        assert len(keys) == 1
        packed = gemm._PACK_CACHE[keys[0]][2]
        assert torch.equal(moe._amx_groups(x, param, offsets, wsel), y1)
        assert gemm._PACK_CACHE[keys[0]][2] is packed  # reused, not repacked
        with torch.no_grad():
            param.mul_(2)
        assert torch.equal(moe._amx_groups(x, param, offsets, wsel), 2 * y1)
        param.data.copy_(w)  # no version bump: stale until cleared
        assert torch.equal(moe._amx_groups(x, param, offsets, wsel), 2 * y1)
        gemm.clear_packed_weight_cache()
        assert torch.equal(moe._amx_groups(x, param, offsets, wsel), y1)
    finally:
        gemm.enable_packed_weight_cache(False)


def test_refuses_what_it_cannot_run(monkeypatch):
    """fp16, shapes that do not multiply, another device, and a CPU without AMX are errors,
    never a silent fallback to another GEMM."""
    x, w = _inputs(4, 16, 32, seed=0)
    offsets, wsel = _groups([4], [0])
    with pytest.raises(TypeError, match="bf16"):
        moe._amx_groups(x.half(), w.half(), offsets, wsel)
    with pytest.raises(ValueError, match="do not multiply"):
        moe._amx_groups(x[:, :31], w, offsets, wsel)
    with pytest.raises(ValueError, match="run on CPU"):
        moe._amx_groups(x.to("meta"), w, offsets, wsel)
    monkeypatch.setattr(moe, "amx_available", lambda: False)
    with pytest.raises(RuntimeError, match="AMX-BF16"):
        moe._amx_groups(x, w, offsets, wsel)
    assert moe.expert_gemm(torch.bfloat16) == moe.LINEAR_BLOCKS
