"""The C++-registered CPU operators (`torch.ops.isoexec_cpu`, `ops.cpu_torch_ops`) against the
Python ops they stand in for in the engine: the same bits for every layout and dtype the
engine passes, the same refusals, and the packed-weight cache protocol (its negative control:
a `.data` write stays invisible until the owner clears, as with the Python cache)."""

from __future__ import annotations

import gc

import pytest
import torch
from _ops_testlib import num_threads

from isoexec import ops
from isoexec.ops import cpu_torch_ops, gemm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

cpu_torch_ops.load()
NATIVE = torch.ops.isoexec_cpu


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _norm_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """x layouts the engine's graph passes: rows, heads split out of a wider qkv row (strided
    3-D views), a transposed view (dense, permuted), a non-last-dim-contiguous view."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 1024, generator=g).to(dtype)
    return {
        "rows": torch.randn(9, 512, generator=g).to(dtype),
        "q_heads": qkv[:, :512].view(9, 4, 128),
        "k_heads": qkv[:, 512:768].view(9, 2, 128),
        "permuted": torch.randn(4, 9, 128, generator=g).to(dtype).transpose(0, 1),
        "strided_last": torch.randn(9, 256, generator=g).to(dtype)[:, ::2],
        "one_row": torch.randn(1, 128, generator=g).to(dtype),
        "4d": torch.randn(2, 3, 4, 128, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_bits_equal_the_python_op(dtype: torch.dtype, zero_centered: bool) -> None:
    for name, x in _norm_inputs(dtype).items():
        for w_dtype in {dtype, torch.float32}:
            w = torch.randn(x.shape[-1]).to(w_dtype)
            got = NATIVE.rms_norm(x, w, 1e-6, zero_centered)
            want = ops.rms_norm(x, w, 1e-6, zero_centered=zero_centered)
            assert torch.equal(got, want), (name, w_dtype)
            assert got.stride() == want.stride(), name  # the same layout for the graph


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual_bits_equal_the_python_op(dtype: torch.dtype) -> None:
    for name, x in _norm_inputs(dtype).items():
        for r_dtype in {dtype, torch.float32}:  # a residual of another dtype is cast first
            r = torch.randn(x.shape).to(r_dtype)
            w = torch.randn(x.shape[-1]).to(dtype)
            y, r_out = NATIVE.rms_norm_residual(x, w, 1e-5, False, r)
            y_py, r_py = ops.rms_norm(x, w, 1e-5, residual=r)
            assert torch.equal(y, y_py) and torch.equal(r_out, r_py), (name, r_dtype)


def test_rms_norm_negative_control_sees_other_arguments() -> None:
    """The comparison above can fail: another eps or the zero-centred weight give other bits."""
    x, w = torch.randn(9, 512), torch.randn(512)
    base = NATIVE.rms_norm(x, w, 1e-6, False)
    assert not torch.equal(base, ops.rms_norm(x, w, 1e-6, zero_centered=True))
    assert not torch.equal(base, ops.rms_norm(x, w, 1e-2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_bits_equal_the_python_op(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    w = _param(torch.randn(300, 520, generator=g).to(dtype))
    b = torch.randn(300, generator=g).to(dtype)
    wide = torch.randn(7, 1040, generator=g).to(dtype)
    xs = {
        "rows": torch.randn(7, 520, generator=g).to(dtype),
        "one_row": torch.randn(1, 520, generator=g).to(dtype),
        "vector": torch.randn(520, generator=g).to(dtype),
        "3d": torch.randn(2, 5, 520, generator=g).to(dtype),
        "column_slice": wide[:, 260:780],  # rows a stride apart: no copy
        "every_other": wide[:, ::2],  # no unit stride: copied, as the Python op does
        "no_rows": torch.randn(0, 520, generator=g).to(dtype),
    }
    for name, x in xs.items():
        for bias in (None, b, b.float()):
            got = NATIVE.linear(x, w, bias)
            assert torch.equal(got, ops.linear(x, w, bias)), (name, bias is None)
            assert got.shape == (*x.shape[:-1], 300)


def test_linear_rows_ignore_the_batch_and_threads() -> None:
    """The kernel's invariance reaches through the wrapper: a row alone, in a batch of 301,
    at 1 and 2 threads, has the same bits."""
    w = _param(torch.randn(96, 256))
    x = torch.randn(301, 256)
    with num_threads(2):
        batch = NATIVE.linear(x, w, None)
    with num_threads(1):
        alone = torch.cat([NATIVE.linear(x[i : i + 1], w, None) for i in range(0, 301, 50)])
    assert torch.equal(alone, batch[::50])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_bits_equal_the_python_op(dtype: torch.dtype) -> None:
    """Every length's tail included (the padding is what makes silu position-invariant), at
    1 and 2 threads, from strided views; the negative control: torch's silu on the unpadded
    gate differs somewhere (its scalar tail), so the padding is not a no-op."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 8000, generator=g).to(dtype)
    xs = [torch.randn(m, 2 * i, generator=g).to(dtype) for m in (1, 3, 8) for i in (1, 5, 40, 1536)]
    xs += [
        wide[:, :3072],
        torch.randn(2, 4, 96, generator=g).to(dtype),
        torch.randn(0, 64).to(dtype),
    ]
    for threads in (1, 2):
        with num_threads(threads):
            for x in xs:
                got = NATIVE.silu_mul(x)
                assert torch.equal(got, ops.silu_mul(x)), (tuple(x.shape), threads)
    x = torch.randn(1, 2 * 4099, generator=g)  # a length ATen's vector loop leaves a tail of
    unpadded = torch.nn.functional.silu(x[..., :4099]) * x[..., 4099:]
    assert not torch.equal(NATIVE.silu_mul(x), unpadded)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_bits_equal_the_python_op(dtype: torch.dtype) -> None:
    """Decode and prefill positions, far positions (past the tables' first 4096 rows: both grow),
    partial rotary (Qwen3-Next), q and k widths, a strided view; at 1 and 2 threads. The
    reference is the engine's Python path: `apply_rope_at` (the table lookup) and, for the
    same bits, the formula `apply_rope(x, *rope_cos_sin(...))`."""
    g = torch.Generator().manual_seed(4)
    cases = [  # (positions, heads, head_size, rotary_dim, base)
        (torch.arange(8) + 40, 4, 128, 128, 1e6),
        (torch.arange(300), 2, 128, 128, 1e4),
        (torch.tensor([0, 4095, 4096, 40959, 131071]), 3, 64, 64, 5e5),
        (torch.arange(5) + 17, 16, 256, 64, 1e7),  # partial rotary
        (torch.tensor([-3, 0, 5, 2]), 2, 128, 128, 1e4),  # a position no table holds
    ]
    for threads in (1, 2):
        with num_threads(threads):
            for pos, h, d, rot, base in cases:
                x = torch.randn(pos.shape[0], h * d, generator=g).to(dtype)
                want = ops.apply_rope_at(x.view(-1, h, d), pos, rot, base).reshape(x.shape)
                got = NATIVE.rope(pos, x, d, rot, base)
                assert torch.equal(got, want), (tuple(pos[:3].tolist()), h, d, rot, threads)
                formula = ops.apply_rope(x.view(-1, h, d), *ops.rope_cos_sin(pos, rot, base), rot)
                assert torch.equal(got, formula.reshape(x.shape))
    wide = torch.randn(6, 3 * 128, generator=g)
    pos = torch.arange(6) + 9
    got = NATIVE.rope(pos, wide[:, :256], 128, 128, 1e6)  # rows a stride apart
    assert torch.equal(
        got, ops.apply_rope_at(wide[:, :256].reshape(6, 2, 128), pos, 128, 1e6).reshape(6, 256)
    )
    # negative control: another base or the positions shifted by one give other bits
    assert not torch.equal(got, NATIVE.rope(pos, wide[:, :256], 128, 128, 1e4))
    assert not torch.equal(got, NATIVE.rope(pos + 1, wide[:, :256], 128, 128, 1e6))


def test_refusals_are_loud() -> None:
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="differ"):
        NATIVE.linear(x, w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="fp32/bf16/fp16"):
        NATIVE.linear(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match="against weight"):
        NATIVE.linear(torch.randn(3, 63), w, None)
    with pytest.raises(RuntimeError, match="weight"):
        NATIVE.rms_norm(x, torch.randn(63), 1e-6, False)
    with pytest.raises(RuntimeError, match="residual"):
        NATIVE.rms_norm_residual(x, torch.randn(64), 1e-6, False, torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="fp32/bf16/fp16"):
        NATIVE.rms_norm(x.double(), torch.randn(64), 1e-6, False)
    with pytest.raises(RuntimeError, match="rotary_dim"):
        NATIVE.rope(torch.arange(3), x, 64, 65, 1e4)
    with pytest.raises(RuntimeError, match="positions"):
        NATIVE.rope(torch.arange(4), x, 64, 64, 1e4)
    assert cpu_torch_ops.runs_linear(x, w) and not cpu_torch_ops.runs_linear(x.double(), w)


def test_linear_cache_follows_the_python_protocol() -> None:
    """Off by default; enabled, a `.data` write is stale until `clear_packed_weight_cache()`
    (the negative control: the cache is really used), an in-place update is seen at once,
    a dead weight's entry goes, and an inference tensor is never cached."""
    w = _param(torch.randn(64, 48))
    x = torch.randn(3, 48)
    assert not gemm._PACK_CACHE_ENABLED
    NATIVE.linear(x, w, None)
    assert cpu_torch_ops.pack_cache_size() == 0
    gemm.enable_packed_weight_cache()
    try:
        y0 = NATIVE.linear(x, w, None)
        assert cpu_torch_ops.pack_cache_size() == 1
        w.data.copy_(torch.randn(64, 48))  # a write that does not bump w._version
        assert torch.equal(NATIVE.linear(x, w, None), y0)  # stale, as the protocol says
        gemm.clear_packed_weight_cache()
        assert cpu_torch_ops.pack_cache_size() == 0
        fresh = ops.linear(x, w.detach().clone())
        assert torch.equal(NATIVE.linear(x, w, None), fresh)
        with torch.no_grad():
            w.add_(1.0)  # bumps _version: repacked without a clear
        assert torch.equal(NATIVE.linear(x, w, None), ops.linear(x, w.detach().clone()))
        assert cpu_torch_ops.pack_cache_size() == 1
        w.data = torch.randn(64, 48)  # new storage: another key
        assert torch.equal(NATIVE.linear(x, w, None), ops.linear(x, w.detach().clone()))
        other = _param(torch.randn(64, 48))
        del w
        gc.collect()
        NATIVE.linear(x, other, None)  # an insert drops entries whose storage died
        assert cpu_torch_ops.pack_cache_size() == 1
        with torch.inference_mode():
            temp = torch.randn(64, 48)
            NATIVE.linear(x, temp, None)
        assert cpu_torch_ops.pack_cache_size() == 1
    finally:
        gemm.enable_packed_weight_cache(False)
    assert cpu_torch_ops.pack_cache_size() == 0


def test_fakes_trace_under_compile() -> None:
    """torch.compile sees the operators through their fake implementations (fullgraph: no
    break), and the compiled function calls the same operators: the same bits as eager."""
    w = _param(torch.randn(96, 128))
    wn = torch.randn(128)

    def step(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, r2 = NATIVE.rms_norm_residual(x, wn, 1e-6, False, r)
        h = NATIVE.linear(NATIVE.rms_norm(y, wn, 1e-6, False), w, None)
        return h, r2

    x, r = torch.randn(5, 128), torch.randn(5, 128)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(x, r), step(x, r), strict=True):
        assert torch.equal(a, b)
