"""linear: row invariance (batch size, neighbours, threads), TP invariance, accuracy, grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import assert_row_invariant, assert_row_variant, num_threads, ulp_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from isoexec.ops import (
    gemm,
    get_impl,
    linear,
    linear_tp_invariant,
    onednn_rows,
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


def test_linear_block_rows_is_a_real_parameter():
    """Another tile size is another contract: the ImplInfo changes (and bits may change)."""
    assert get_impl("linear", block_rows=64) != get_impl("linear")
    assert get_impl("linear", block_rows=64).param_dict()["block_rows"] == "64"
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, K, generator=g), torch.randn(N, K, generator=g)
    ys = {r: linear(x, w, block_rows=r) for r in (1, 32)}
    assert not torch.equal(ys[1], ys[32])  # M=1-shaped GEMM vs 32-row GEMM


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
def _branch(monkeypatch, dtype: torch.dtype) -> str:
    """The branch `_block_gemm` takes for `dtype`: "prepacked" (oneDNN `_linear_pointwise` on
    a packed weight) or "mm" (`torch.mm`), seen by spying on the packing helper."""
    calls: list[int] = []
    real = gemm._packed_weight
    monkeypatch.setattr(gemm, "_packed_weight", lambda w, r: calls.append(r) or real(w, r))
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(40, 64, generator=g).to(dtype), torch.randn(16, 64, generator=g).to(dtype)
    gemm._block_gemm(x, w, 32)
    return "prepacked" if calls else "mm"


@pytest.mark.skipif(not gemm._onednn_available(), reason="torch built without oneDNN")
def test_gemm_library_names_the_branch_block_gemm_takes(monkeypatch):
    assert _branch(monkeypatch, torch.float32) == "prepacked"
    assert gemm_library("cpu", torch.float32) == "onednn-prepacked"
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN has bf16 on this CPU
    assert _branch(monkeypatch, torch.bfloat16) == ("prepacked" if bf16 else "mm")
    assert gemm_library("cpu", torch.bfloat16) == ("onednn-prepacked" if bf16 else "aten-cpublas")
    assert _branch(monkeypatch, torch.float16) == "mm"  # torch.mm: oneDNN where it has fp16
    fp16 = torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert gemm_library("cpu", torch.float16) == ("onednn" if fp16 else "aten-cpublas")
    blas = "mkl" if torch.backends.mkl.is_available() else gemm._cpu_blas()
    # Without our oneDNN path: fp32 goes to torch.mm, i.e. the build's BLAS; bf16 to torch.mm
    # too, which hands it to oneDNN's matmul where oneDNN has bf16.
    monkeypatch.setattr(gemm, "_onednn_available", lambda: False)
    assert _branch(monkeypatch, torch.float32) == "mm"
    assert gemm_library("cpu", torch.float32) == blas
    assert _branch(monkeypatch, torch.bfloat16) == "mm"
    assert gemm_library("cpu", torch.bfloat16) == ("onednn" if bf16 else "aten-cpublas")
    # Without oneDNN at all, bf16 torch.mm cannot use it either.
    monkeypatch.undo()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert _branch(monkeypatch, torch.float32) == "mm"
    assert gemm_library("cpu", torch.float32) == blas
    assert gemm_library("cpu", torch.bfloat16) == "aten-cpublas"


_VERBOSE_PROBE = """
import sys, torch
from isoexec.ops import gemm
x, w = torch.randn(64, 256), torch.randn(128, 256)
for name, dtype, ours in (("fp32", torch.float32, True), ("bf16", torch.bfloat16, True),
                          ("fp32-no-onednn", torch.float32, False)):
    gemm._onednn_available = (lambda: True) if ours else (lambda: False)
    print("@@", name, gemm.gemm_library("cpu", dtype), flush=True)
    gemm._block_gemm(x.to(dtype), w.to(dtype), 32)
    sys.stdout.flush()
"""


@pytest.mark.skipif(
    not (gemm._onednn_available() and torch.backends.mkl.is_available()),
    reason="needs a torch build with oneDNN and MKL (their verbose logs name the library)",
)
def test_gemm_library_is_the_library_that_runs():
    """The libraries' own logs (ONEDNN_VERBOSE, MKL_VERBOSE) show the recorded one running."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _VERBOSE_PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    runs: dict[str, tuple[str, str]] = {}
    for part in out.split("@@ ")[1:]:
        head, _, log = part.partition("\n")
        name, lib = head.split()
        ran = [ln for ln in log.splitlines() if ",exec," in ln or ln.startswith("MKL_VERBOSE ")]
        runs[name] = (lib, "\n".join(ran))
    lib, log = runs["fp32"]
    assert lib == "onednn-prepacked" and ",inner_product," in log and "SGEMM" not in log
    lib, log = runs["fp32-no-onednn"]
    assert lib == "mkl" and "SGEMM" in log and "onednn_verbose" not in log
    lib, log = runs["bf16"]
    if lib == "onednn-prepacked":
        assert ",inner_product," in log and "MKL_VERBOSE" not in log


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


def _padded_reference(x: torch.Tensor, w: torch.Tensor, r: int) -> torch.Tensor:
    """The definition: every block of r rows, the last zero-padded, as one r-row GEMM."""
    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, -(-m // r) * r - m))
    wp = torch.ops.mkldnn._reorder_linear_weight(w, r)
    return torch.cat([onednn_rows.onednn_rows(b.contiguous(), wp) for b in xp.split(r)])[:m]


@pytest.mark.skipif(not gemm._onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(512, 1536), (1536, 512), (1024, 300)])
def test_short_last_block_has_the_padded_blocks_bits(dtype, k, n):
    """A last block of m < 32 rows computes only its m rows where oneDNN was checked to give
    them the padded block's bits (#37: a decode step of 8 sequences paid for 32 rows): every m
    from 1 to 33, at 1 and 2 threads, gives the bits of the zero-padded 32-row blocks."""
    if not gemm._prepacked(dtype):
        pytest.skip(f"oneDNN has no prepacked {dtype} GEMM on this CPU")
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(33, k, generator=g).to(dtype)
    for threads in (1, 2):
        with num_threads(threads):
            for m in range(1, 34):
                want = _padded_reference(x[:m], w, 32)
                assert torch.equal(linear(x[:m], w), want), (threads, m)


@pytest.mark.skipif(not gemm._onednn_available(), reason="torch built without oneDNN")
def test_short_block_pads_where_the_check_sees_other_bits(monkeypatch):
    """Negative control: a GEMM whose rows change with the row count (as oneDNN's do at m = 1
    on some shapes) fails the check, and the block is padded: the result is the padded one."""
    real = onednn_rows.onednn_rows

    def row_count_dependent(x, packed):
        y = real(x, packed)
        return y if x.shape[0] == 32 else y * (1 + 2**-20)

    monkeypatch.setattr(onednn_rows, "onednn_rows", row_count_dependent)
    monkeypatch.setattr(gemm, "onednn_rows", row_count_dependent)
    monkeypatch.setattr(onednn_rows, "SHORT_BLOCK_ROWS", {})
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(N, K, generator=g), torch.randn(8, K, generator=g)
    got = linear(x, w)
    assert set(onednn_rows.SHORT_BLOCK_ROWS.values()) == {32}  # checked, refused: padded
    assert torch.equal(got, real(F.pad(x, (0, 0, 0, 24)), gemm._packed_weight(w, 32))[:8])
    # without the fake: the same bits, whichever way this CPU's check goes
    monkeypatch.setattr(onednn_rows, "onednn_rows", real)
    monkeypatch.setattr(gemm, "onednn_rows", real)
    monkeypatch.setattr(onednn_rows, "SHORT_BLOCK_ROWS", {})
    assert torch.equal(linear(x, w), got)


@pytest.mark.skipif(not gemm._onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(512, 1536), (1536, 512), (1024, 300)])
def test_whole_blocks_in_one_call_have_each_blocks_bits(dtype, k, n):
    """Whole blocks run as one oneDNN call where the check saw that give each block's bits
    (#37: a prefill or a micro-batch streamed the weight once per 32 rows): 2 to 12 blocks,
    with and without a short tail, at 1 and 2 threads, give the bits of the blocks computed
    one by one as the definition says."""
    if not gemm._prepacked(dtype):
        pytest.skip(f"oneDNN has no prepacked {dtype} GEMM on this CPU")
    g = torch.Generator().manual_seed(k + n + 1)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(12 * 32 + 5, k, generator=g).to(dtype)
    for threads in (1, 2):
        with num_threads(threads):
            for m in (64, 69, 96, 256, 261, 384):
                assert torch.equal(linear(x[:m], w), _padded_reference(x[:m], w, 32)), (threads, m)
    seen = {key[4] for key in onednn_rows.WHOLE_BLOCKS_AT_ONCE if key[:3] == (n, k, dtype)}
    assert {2, 3, 8, 12} <= seen  # the check ran for each block count


@pytest.mark.skipif(not gemm._onednn_available(), reason="torch built without oneDNN")
def test_whole_blocks_run_one_by_one_where_the_check_sees_other_bits(monkeypatch):
    """Negative control: a GEMM whose rows change when a call holds more than one block fails
    the check, and the blocks run one by one: the result is the definition's."""
    real = onednn_rows.onednn_rows

    def block_count_dependent(x, packed):
        y = real(x, packed)
        return y if x.shape[0] <= 32 else y * (1 + 2**-20)

    monkeypatch.setattr(onednn_rows, "onednn_rows", block_count_dependent)
    monkeypatch.setattr(gemm, "onednn_rows", block_count_dependent)
    monkeypatch.setattr(onednn_rows, "WHOLE_BLOCKS_AT_ONCE", {})
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(N, K, generator=g), torch.randn(128, K, generator=g)
    got = linear(x, w)
    assert list(onednn_rows.WHOLE_BLOCKS_AT_ONCE.values()) == [False]  # checked, refused
    assert torch.equal(got, _padded_reference(x, w, 32))
    # the fake is caught, not a coincidence: one call over the 4 blocks has other bits
    assert not torch.equal(block_count_dependent(x, gemm._packed_weight(w, 32)), got)
