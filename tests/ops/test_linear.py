"""linear: row invariance (batch size, neighbours, threads), TP invariance, accuracy, grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import assert_row_invariant, assert_row_variant, num_threads, ulp_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from isoexec.ops import (
    get_impl,
    linear,
    linear_tp_invariant,
    tp_leaf_partials,
    tp_linear_from_shards,
    tp_tree_sum,
)
from isoexec.ops.gemm import gemm_library

K, N = 1024, 256


def _gen(dtype):
    def gen(m, g):
        return (torch.randn(m, K, generator=g).to(dtype),)

    return gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_invariant(dtype):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert_row_invariant(lambda x: linear(x, w), _gen(dtype))


def test_linear_negative_control_native_differs():
    """F.linear fp32: a row alone (M=1) differs from the same row in a batch (M>=16)."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    assert_row_variant(lambda x: F.linear(x, w), _gen(torch.float32))


@pytest.mark.parametrize("block_rows", [1, 8, 64])
def test_linear_other_block_rows_invariant(block_rows):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2))
    assert_row_invariant(
        lambda x: linear(x, w, block_rows=block_rows), _gen(torch.float32), sizes=(1, 7, 70)
    )


def test_linear_block_rows_is_a_real_parameter(monkeypatch):
    """Another tile size is another contract (the ImplInfo changes): on CUDA the blocks are
    fixed-shape `torch.mm` calls whose bits depend on it. The CPU kernel has no row blocks,
    so there its bits do not move; the block path (fp64 here, CUDA in use) does depend on it."""
    assert get_impl("linear", block_rows=64) != get_impl("linear")
    assert get_impl("linear", block_rows=64).param_dict()["block_rows"] == "64"
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, K, generator=g), torch.randn(N, K, generator=g)
    assert torch.equal(linear(x, w, block_rows=1), linear(x, w, block_rows=32))
    calls: list[tuple[int, ...]] = []
    real_mm = torch.mm

    def spy(a, b, *, out):
        calls.append(tuple(a.shape))
        return real_mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", spy)
    linear(x.double(), w.double(), block_rows=32)
    assert calls == [(32, K), (32, K)]  # 40 rows: two 32-row blocks, the last zero-padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_tp_invariant_across_tp(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    ref = linear_tp_invariant(x, w, b)
    for tp in (1, 2, 4):
        got = tp_linear_from_shards(list(x.chunk(tp, -1)), list(w.chunk(tp, -1)), b)
        assert torch.equal(got, ref), tp
    # a real rank's view: leaves of its own shard, all-gathered in rank order
    parts = torch.cat(
        [
            tp_leaf_partials(xs, ws, leaves=4)
            for xs, ws in zip(x.chunk(2, -1), w.chunk(2, -1), strict=True)
        ]
    )
    assert torch.equal((tp_tree_sum(parts) + b.float()).to(dtype), ref)
    assert_row_invariant(lambda t: linear_tp_invariant(t, w), _gen(dtype), sizes=(1, 7, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 33, 300])
def test_linear_column_split_invariant(dtype, m):
    """A column-parallel rank computes its output columns from its weight rows alone: every
    column's bits equal the whole-weight GEMM's, for any split (the trainer's TP>1 claim)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, K, generator=g).to(dtype)
    w = torch.randn(4 * 96, K, generator=g).to(dtype)
    full = linear(x, w)
    for tp in (2, 4):
        got = torch.cat([linear(x, ws) for ws in w.chunk(tp, 0)], dim=-1)
        assert torch.equal(got, full), tp
    # and for a permutation of the rows (the trainer's QKV runs on vLLM's row order)
    perm = torch.randperm(w.shape[0], generator=g)
    assert torch.equal(linear(x, w[perm]), full[:, perm])


def test_linear_tp_negative_control_native_sum_differs():
    """Summing per-rank F.linear partials (what an all-reduce does) depends on TP."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(64, K, generator=g), torch.randn(N, K, generator=g)

    def naive(tp):
        parts = [F.linear(xs, ws) for xs, ws in zip(x.chunk(tp, -1), w.chunk(tp, -1), strict=True)]
        return sum(parts[1:], parts[0])

    assert not (torch.equal(naive(1), naive(2)) and torch.equal(naive(1), naive(4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 80), k=st.sampled_from([16, 200, 512]), n=st.integers(1, 70))
def test_linear_accuracy(dtype, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    y = linear(x, w)
    ref = x.double() @ w.double().T
    assert y.dtype == dtype and y.shape == (m, n)
    if dtype == torch.float32:
        # fp32 accumulation over k terms: a few ulps of the sum of |terms|
        scale = x.double().abs() @ w.double().abs().T
        assert ((y.double() - ref).abs() <= 1e-6 * scale + 1e-30).all()
    else:  # one rounding of an fp32-accurate sum
        scale = x.double().abs() @ w.double().abs().T
        assert ((y.double() - ref).abs() <= ulp_bound(ref, dtype) + 1e-6 * scale).all()


def test_linear_leading_dims_bias_and_threads():
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(3, 5, 64, generator=g), torch.randn(7, 64, generator=g), torch.randn(7)
    y = linear(x, w, b)
    assert y.shape == (3, 5, 7)
    assert torch.allclose(y, F.linear(x, w, b), atol=1e-5)
    with num_threads(1):
        assert torch.equal(linear(x, w, b), y)


def test_linear_backward_matches_float64():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 48, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 48, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: linear(x, w, b, block_rows=4), (x, w, b))
    xf = x.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    linear_tp_invariant(xf, wf, leaves=4).square().sum().backward()
    x.grad = w.grad = None
    (x @ w.T).square().sum().backward()
    assert torch.allclose(xf.grad.double(), x.grad, rtol=1e-4, atol=1e-4)
    assert torch.allclose(wf.grad.double(), w.grad, rtol=1e-4, atol=1e-4)


def test_linear_packed_weight_cache_follows_in_place_updates():
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(4, 64, generator=g), torch.randn(8, 64, generator=g)
    y1 = linear(x, w)
    with torch.no_grad():
        w.mul_(2)
    assert torch.allclose(linear(x, w), 2 * y1, rtol=1e-5, atol=1e-5)


# ---- which GEMM library runs (what the contract records) --------------------------------------
def test_gemm_library_on_cuda_records_the_flags_that_change_bits():
    """cuBLAS's reduced-precision switches are part of the record (readable on a CPU build)."""
    m = torch.backends.cuda.matmul
    base = gemm_library("cuda:0", torch.float32)
    assert base.startswith(("cublas", "hipblas", "ck")) and "tf32=" in base
    new_api = hasattr(m, "fp32_precision")
    old = m.fp32_precision if new_api else m.allow_tf32
    try:
        if new_api:
            m.fp32_precision = "tf32"
        else:
            m.allow_tf32 = True
        assert "tf32=true" in gemm_library("cuda", torch.float32) != base
    finally:
        if new_api:
            m.fp32_precision = old
        else:
            m.allow_tf32 = old
    assert gemm_library("cuda", torch.float32) == base
    bf16 = m.allow_bf16_reduced_precision_reduction
    try:
        m.allow_bf16_reduced_precision_reduction = not bf16
        flipped = gemm_library("cuda", torch.bfloat16)
    finally:
        m.allow_bf16_reduced_precision_reduction = bf16
    assert flipped != gemm_library("cuda", torch.bfloat16)
    assert f"reduced_precision_reduction={str(not bf16).lower()}" in flipped


@pytest.mark.parametrize(
    ("device", "dtype", "match"),
    [
        ("mps", torch.float32, "unknown"),
        ("meta", torch.float32, "unknown"),
        ("not-a-device", torch.float32, "cannot identify"),
        ("cpu", torch.float64, "no canonical GEMM"),
    ],
)
def test_gemm_library_refuses_what_it_cannot_identify(device, dtype, match):
    with pytest.raises(ValueError, match=match):
        gemm_library(device, dtype)
