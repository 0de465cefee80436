"""The compiled RMSNorm (`cpu_kernels/norm.cpp`, rms_norm v2): it computes exactly its written
definition, whatever the rows' layout, the batch and the threads; its bits are saved.

The definition, emulated here one IEEE operation at a time (elementwise fp32 torch ops, each
correctly rounded; no library reduction): lane l of 16 adds the squares of elements l, l+16,
... in order, the lanes are added by a fixed pairwise tree, `inv = 1 / sqrt(ss / D + eps)`,
`y = round((x * inv) * w)`. Negative control: the same definition with 8 lanes (another SIMD
width a compiler might pick) gives other bits, so the lane count is pinned by the source.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from _ops_testlib import assert_row_invariant, num_threads

from isoexec.ops import REGISTRY, rms_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _emulated(x, w, eps, *, lanes=16, zero_centered=False, residual=None):
    """The kernel's definition, one rounding per operation (fp32 scalars and vectors)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)  # one add, rounded to x's dtype
    v = x.float()
    d = v.shape[-1]
    pad = (-d) % lanes
    sq = torch.nn.functional.pad(v, (0, pad)).reshape(v.shape[0], -1, lanes)
    sq = sq * sq
    acc = torch.zeros(v.shape[0], lanes)
    for j in range(sq.shape[1]):  # lane by lane, in increasing element order
        acc = acc + sq[:, j]
    width = lanes
    while width > 1:  # (l, l + width/2) pairs, then halves again
        width //= 2
        acc = acc[:, :width] + acc[:, width : 2 * width]
    ss = acc[:, :1]
    # full tensors, not 0-d ones: ATen divides by a CPU scalar as a multiply by its reciprocal
    var = ss / torch.full_like(ss, float(d)) + torch.full_like(ss, eps)
    # IEEE sqrt, correctly rounded: through fp64, exact for an fp32 argument (torch's own fp32
    # sqrt on CPU is not correctly rounded: it differs from IEEE's in about 1 in 6 values)
    inv = torch.ones_like(ss) / torch.sqrt(var.double()).float()
    wf = w.float() + 1.0 if zero_centered else w.float()
    y = ((v * inv) * wf).to(x.dtype)
    return y if residual is None else (y, x)


def _data(rows, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(rows, d, generator=g) * 3).to(dtype), torch.randn(rows, d, generator=g)
    return x, r.to(dtype), torch.randn(d, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [7, 300, 512, 2048])
def test_the_kernel_computes_its_written_definition(dtype, d):
    x, r, w = _data(41, d, dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), _emulated(x, w, 1e-6))
    y, nr = rms_norm(x, w, 1e-5, zero_centered=True, residual=r)
    ey, enr = _emulated(x, w, 1e-5, zero_centered=True, residual=r)
    assert torch.equal(nr, enr) and torch.equal(y, ey)
    assert torch.equal(nr, x + r)  # the residual add is torch's, bit for bit


def test_negative_control_another_lane_count_gives_other_bits():
    x, _, w = _data(64, 300, torch.float32)
    ours, eight = rms_norm(x, w, 1e-6), _emulated(x, w, 1e-6, lanes=8)
    assert torch.equal(ours, _emulated(x, w, 1e-6, lanes=16))
    differ = int((ours != eight).any(-1).sum())
    print(f"8 lanes instead of 16: {differ} of 64 rows differ")
    assert differ > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_invariant_to_batch_threads_and_layout(dtype):
    w = torch.randn(1024, generator=torch.Generator().manual_seed(3)).to(dtype)

    def gen(m, g):
        return ((torch.randn(m, 1024, generator=g) * 2).to(dtype),)

    assert_row_invariant(lambda x: rms_norm(x, w, 1e-6), gen)
    x, r, _ = _data(640, 1024, dtype, seed=4)  # 640 rows: the kernel splits them over threads
    with num_threads(1):
        one = rms_norm(x, w, 1e-6, residual=r)
    with num_threads(2):
        two = rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    # vLLM's q heads: a [T, H, D] view of the wider QKV output, and a row-strided slice
    qkv = (torch.randn(9, 3 * 8 * 128, generator=torch.Generator().manual_seed(5))).to(dtype)
    q = qkv[:, 1024:2048].view(9, 8, 128)
    wq = w[:128]
    assert not q.is_contiguous()
    assert torch.equal(rms_norm(q, wq, 1e-6), rms_norm(q.contiguous(), wq, 1e-6))
    rows = qkv[:, :1024]
    assert torch.equal(rms_norm(rows, w, 1e-6), rms_norm(rows.contiguous(), w, 1e-6))
    # a dense permuted x: the outputs keep its layout (an elementwise torch op's), same bits
    xt = torch.randn(1024, 6, generator=torch.Generator().manual_seed(6)).to(dtype).t()
    y, nr = rms_norm(xt, w, 1e-6, residual=xt)
    assert y.stride() == nr.stride() == xt.stride()
    ref = rms_norm(xt.contiguous(), w, 1e-6, residual=xt.contiguous())
    assert torch.equal(y, ref[0]) and torch.equal(nr, ref[1])


# sha256 of the kernel's output on fixed inputs, at version 2 (plain; zero-centred with a
# residual). The bits are the source's (explicit lanes, no FMA contraction), so they are the
# same on every CPU this runs on. A change here means the op's bits changed: bump its version
# in ops/__init__.py and record the new hash.
SAVED_V2 = {
    torch.float32: "9974232a8166bbf6",
    torch.bfloat16: "afe4ca2b63047ada",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bits_v2(dtype):
    assert REGISTRY["rms_norm"].version == 2
    x, r, w = _data(33, 300, dtype, seed=6)
    y, nr = rms_norm(x, w, 1e-6, zero_centered=True, residual=r)
    out = torch.cat([rms_norm(x, w, 1e-6), y, nr]).float()
    assert hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16] == SAVED_V2[dtype]


def test_what_the_kernel_cannot_run_is_refused():
    x, r, w = _data(3, 16, torch.float32)
    with pytest.raises(ValueError, match="float64"):
        rms_norm(x.double(), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:8], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=r[:2])
