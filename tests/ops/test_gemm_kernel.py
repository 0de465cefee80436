"""The canonical CPU GEMM kernel (`cpu_kernels/gemm.cpp`, linear v2) against its definition.

Definition: y[m, n] = round_T(fma chain over k ascending from +0, in fp32). The oracle below
computes that chain in exact rational arithmetic, rounding each step to fp32 by hand, so it
shares no code and no hardware rounding with the kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from _ops_testlib import num_threads

from isoexec.ops import REGISTRY, cpu_gemm, cpu_kernels, gemm, linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _round_f32(q: Fraction) -> Fraction:
    """q rounded to the nearest fp32, ties to even (exactly: no double rounding)."""
    if q == 0:
        return Fraction(0)  # a chain from +0 never reaches -0: x*w + c = 0 rounds to +0
    r = np.float32(float(q))
    cands = [np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.uint32)) & 1))
    return Fraction(float(best))


def _order(k: int, pairs: bool) -> list[int]:
    """The k order of one chain: ascending, or (bf16) pairs with the odd k first."""
    if not pairs:
        return list(range(k))
    return [j for p in range(0, k, 2) for j in ((p + 1, p) if p + 1 < k else (p,))]


def _oracle(x: torch.Tensor, w: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """The definition's fp32 chains: acc = round_f32(x_k * w_k + acc) in the kernel's k order."""
    order = _order(x.shape[1], x.dtype == torch.bfloat16 if pairs is None else pairs)
    xs = [[Fraction(v) for v in row] for row in x.double().tolist()]
    ws = [[Fraction(v) for v in row] for row in w.double().tolist()]
    out = torch.empty(len(xs), len(ws), dtype=torch.float64)
    for i, xr in enumerate(xs):
        for j, wr in enumerate(ws):
            acc = Fraction(0)
            for k in order:
                acc = _round_f32(xr[k] * wr[k] + acc)
            out[i, j] = float(acc)
    return out.float()  # exact


def _chains(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's fp32 chains before the final rounding."""
    return cpu_gemm.panel_gemm(x, cpu_gemm.pack_panels(w), w.shape[0], fp32_out=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [45, 46])
def test_kernel_is_the_fma_chain_bit_for_bit(dtype, k):
    """Every fp32 chain equals the exact-arithmetic chain in the definition's order, and the
    output is that chain rounded once; 37 columns cross a 32-column panel and end in a partial
    one, 11 rows a full 8-row tile and a partial one, an odd K ends bf16 on a single k."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, k, generator=g).to(dtype)
    w = torch.randn(37, k, generator=g).to(dtype)
    want = _oracle(x, w)
    assert torch.equal(_chains(x, w), want)
    assert torch.equal(linear(x, w), want.to(dtype))


def test_kernel_oracle_sees_a_changed_order():
    """Negative control: the same products summed k descending give other bits, and the
    oracle tells them apart: the test above can fail. (Built in, not borrowed from a BLAS:
    a vendor GEMM may well accumulate k ascending too.)"""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 300, generator=g), torch.randn(40, 300, generator=g)
    want = _oracle(x, w)
    assert torch.equal(linear(x, w), want)
    assert not torch.equal(linear(x.flip(-1), w.flip(-1)), want)
    # bf16: the pairs' odd-first order is visible in the fp32 chains
    xb, wb = x[:2, :64].bfloat16(), w[:8, :64].bfloat16()
    assert torch.equal(_chains(xb, wb), _oracle(xb, wb))
    assert not torch.equal(_chains(xb, wb), _oracle(xb, wb, pairs=False))


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
    """K = 0 gives +0s, M = 0 an empty result; a packed weight of another K or dtype, or with
    fewer columns than asked for, is refused loudly rather than read past."""
    empty_k = cpu_gemm.pack_panels(torch.ones(5, 0))
    assert torch.equal(cpu_gemm.panel_gemm(torch.ones(3, 0), empty_k, 5), torch.zeros(3, 5))
    assert linear(torch.ones(0, 8), torch.ones(5, 8)).shape == (0, 5)
    packed = cpu_gemm.pack_panels(torch.ones(5, 8))
    with pytest.raises(ValueError, match="packed weight"):
        cpu_gemm.panel_gemm(torch.ones(2, 9), packed, 5)
    with pytest.raises(ValueError, match="packed weight"):
        cpu_gemm.panel_gemm(torch.ones(2, 8, dtype=torch.float16), packed, 5)
    with pytest.raises(ValueError, match="packed weight"):  # more columns than it holds
        cpu_gemm.panel_gemm(torch.ones(2, 8), packed, 33)


# sha256 of the kernel's output on fixed inputs. The bits are the source's (one fused
# multiply-add per k, k ascending), so they are the same on every CPU (CI draws Intel and
# AMD). A change here means linear's bits changed: bump its version and record the hash.
SAVED_V2 = {
    torch.float32: "24923045aa14f711",
    torch.bfloat16: "b88d557fccb06bc3",
    torch.float16: "653791decc5cdf2c",
}


SAVED_V2_BF16_CHAINS = "4bf0f7882f0742cb"


@pytest.mark.parametrize("dtype", DTYPES)
def test_saved_bits_v2(dtype):
    assert REGISTRY["linear"].version == 2
    g = torch.Generator().manual_seed(10)
    x = torch.randn(45, 700, generator=g).to(dtype)
    w = (torch.randn(99, 700, generator=g) * 0.1).to(dtype)
    digest = hashlib.sha256(linear(x, w).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    assert digest == SAVED_V2[dtype], digest
    if dtype == torch.bfloat16:  # the bf16 rounding hides most of the order: the fp32 chains
        chains = hashlib.sha256(_chains(x, w).numpy().tobytes()).hexdigest()[:16]
        assert chains == SAVED_V2_BF16_CHAINS, chains


def _build_without_bf16_dot(tmp_path) -> ctypes.CDLL:
    """The gemm kernel built as a CPU without VDPBF16PS builds it: two FMAs under FTZ/DAZ."""
    src = Path(cpu_kernels.__file__).parent
    so = tmp_path / "gemm-emulated.so"
    cmd = [cpu_kernels._compiler(), *cpu_kernels.CXX_FLAGS, "-mno-avx512bf16", f"-I{src}"]
    subprocess.run([*cmd, str(src / "gemm.cpp"), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.isx_gemm.restype = ctypes.c_int
    lib.isx_gemm.argtypes = cpu_gemm._kernel().argtypes
    return lib


def test_bf16_pairs_without_the_instruction_give_its_bits(tmp_path):
    """CI draws CPUs with and without AVX512-BF16: the emulated pair step (two FMAs under
    flush-to-zero and denormals-are-zero) gives the instruction's bits, denormal inputs and
    underflowing products included; without FTZ/DAZ the emulation would differ there."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 130, generator=g)
    w = torch.randn(70, 130, generator=g)
    x[0] *= 1e-20  # with w[:5]: products in fp32's denormal range
    w[:5] *= 1e-20
    x[1] *= 1e-39  # bf16 denormal inputs
    x, w = x.bfloat16(), w.bfloat16()
    packed = cpu_gemm.pack_panels(w)
    lib = _build_without_bf16_dot(tmp_path)
    for fp32_out in (True, False):
        want = cpu_gemm.panel_gemm(x, packed, 70, fp32_out=fp32_out)
        got = torch.empty_like(want)
        rc = lib.isx_gemm(
            x.data_ptr(), 9, 130, 70, 130, packed.data_ptr(), got.data_ptr(),
            cpu_kernels.DTYPE_CODES[torch.bfloat16], int(fp32_out), 2,
        )  # fmt: skip
        assert rc == 0 and torch.equal(got.view(torch.int16), want.view(torch.int16)), fp32_out
    chains = cpu_gemm.panel_gemm(x, packed, 70, fp32_out=True)
    assert torch.equal(chains[2:], _oracle(x[2:], w))  # normal rows: the plain definition
    # the flushes are real: exact chains of denormal products are not zero, the kernel's are
    assert (_oracle(x[:1], w[:5]) != 0).all() and (chains[0, :5] == 0).all()
    assert (_oracle(x[1:2], w[5:]) != 0).all() and (chains[1] == 0).all()  # read as 0
