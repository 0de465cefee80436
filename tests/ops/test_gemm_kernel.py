"""The canonical CPU GEMM kernel (`cpu_kernels/gemm.cpp`, linear v2) against its definition.

Definition: y[m, n] = round_T(fma chain over k ascending from +0, in fp32). The oracle below
computes that chain in exact rational arithmetic, rounding each step to fp32 by hand, so it
shares no code and no hardware rounding with the kernel.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _ops_testlib import num_threads

from isoexec.ops import REGISTRY, cpu_gemm, gemm, linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _round_f32(q: Fraction) -> Fraction:
    """q rounded to the nearest fp32, ties to even (exactly: no double rounding)."""
    if q == 0:
        return Fraction(0)  # a chain from +0 never reaches -0: x*w + c = 0 rounds to +0
    r = np.float32(float(q))
    cands = [np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.uint32)) & 1))
    return Fraction(float(best))


def _oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The definition, one output at a time: acc = round_f32(x_k * w_k + acc), k ascending."""
    xs = [[Fraction(v) for v in row] for row in x.double().tolist()]
    ws = [[Fraction(v) for v in row] for row in w.double().tolist()]
    out = torch.empty(len(xs), len(ws), dtype=torch.float64)
    for i, xr in enumerate(xs):
        for j, wr in enumerate(ws):
            acc = Fraction(0)
            for a, b in zip(xr, wr, strict=True):
                acc = _round_f32(a * b + acc)
            out[i, j] = float(acc)
    return out.float().to(x.dtype)  # exact to fp32, then one rounding to T (ties to even)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_the_fma_chain_bit_for_bit(dtype):
    """Every output equals the exact-arithmetic chain; 37 columns cross a 32-column panel and
    end in a partial one, 11 rows a full 8-row tile and a partial one."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 45, generator=g).to(dtype)
    w = torch.randn(37, 45, generator=g).to(dtype)
    assert torch.equal(linear(x, w), _oracle(x, w))


def test_kernel_oracle_sees_a_changed_order():
    """Negative control: the same products summed k descending (or by torch's GEMM) give
    other bits, and the oracle tells them apart: the test above can fail."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 300, generator=g), torch.randn(40, 300, generator=g)
    want = _oracle(x, w)
    assert torch.equal(linear(x, w), want)
    assert not torch.equal(linear(x.flip(-1), w.flip(-1)), want)
    assert not torch.equal(F.linear(x, w), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_ignore_the_batch_the_threads_and_the_layout(dtype):
    """A row's bits are the same alone, in any batch, at 1 and 2 threads, and read from a
    strided view (a K-leaf's columns) or a contiguous copy."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 512, generator=g).to(dtype)
    x = torch.randn(301, 512, generator=g).to(dtype)
    alone = torch.cat([linear(x[i : i + 1], w) for i in range(0, 301, 25)])
    for threads in (1, 2):
        with num_threads(threads):
            for m in (1, 7, 8, 9, 64, 301):
                y = linear(x[:m], w)
                for i in range(0, m, 25):
                    assert torch.equal(y[i], alone[i // 25]), (threads, m, i)
    wide = torch.randn(301, 1024, generator=g).to(dtype)
    wide[:, 256:768] = x
    assert torch.equal(linear(wide[:, 256:768], w), linear(x, w))


def test_bits_ignore_torchs_gemm_settings():
    """No BLAS, oneDNN or math-mode setting reaches the kernel: a oneDNN fp32 math mode that
    lets `torch.mm` round inputs to bf16 leaves the canonical bits alone, and the contract
    records the kernel whatever is set."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(16, 256, generator=g), torch.randn(64, 256, generator=g)
    before = linear(x, w)
    matmul = torch.backends.mkldnn.matmul
    old = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        assert torch.equal(linear(x, w), before)
        assert gemm.gemm_library("cpu", torch.float32) == gemm.CPU_GEMM
    finally:
        matmul.fp32_precision = old
    for dtype in DTYPES:
        assert gemm.gemm_library("cpu", dtype) == gemm.CPU_GEMM


def test_edges_and_refusals():
    """K = 0 gives +0s, M = 0 an empty result; a packed weight of another K or dtype is
    refused loudly rather than read past."""
    empty_k = cpu_gemm.pack_panels(torch.ones(5, 0))
    assert torch.equal(cpu_gemm.panel_gemm(torch.ones(3, 0), empty_k, 5), torch.zeros(3, 5))
    assert linear(torch.ones(0, 8), torch.ones(5, 8)).shape == (0, 5)
    packed = cpu_gemm.pack_panels(torch.ones(5, 8))
    with pytest.raises(ValueError, match="packed weight"):
        cpu_gemm.panel_gemm(torch.ones(2, 9), packed, 5)
    with pytest.raises(ValueError, match="packed weight"):
        cpu_gemm.panel_gemm(torch.ones(2, 8, dtype=torch.bfloat16), packed, 5)


# sha256 of the kernel's output on fixed inputs. The bits are the source's (one fused
# multiply-add per k, k ascending), so they are the same on every CPU (CI draws Intel and
# AMD). A change here means linear's bits changed: bump its version and record the hash.
SAVED_V2 = {
    torch.float32: "24923045aa14f711",
    torch.bfloat16: "b88d557fccb06bc3",
    torch.float16: "653791decc5cdf2c",
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_saved_bits_v2(dtype):
    assert REGISTRY["linear"].version == 2
    g = torch.Generator().manual_seed(10)
    x = torch.randn(45, 700, generator=g).to(dtype)
    w = (torch.randn(99, 700, generator=g) * 0.1).to(dtype)
    digest = hashlib.sha256(linear(x, w).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    assert digest == SAVED_V2[dtype], digest
