"""`torch.ops.isoexec_cpu.moe_combine` (`cpu_kernels/torch_ops_moe.cpp`) against the Python
`ops.moe_combine` it stands in for in the engine: the same bits for each expert GEMM it runs,
with and without a shared expert and its gate, at decode and prefill sizes, with the packed
weight cache on and off; negative controls: another routing or another expert GEMM gives
other bits."""

from __future__ import annotations

import pytest
import torch
from _ops_testlib import num_threads

from isoexec import ops
from isoexec.ops import cpu_torch_ops, gemm, moe

cpu_torch_ops.load()
NATIVE = torch.ops.isoexec_cpu
LANES = moe.DEFAULT_LANES

# (dtype, expert GEMM) pairs whose Python op runs the same GEMM here: fp32 is always the
# grouped kernel; bf16 runs the linear's blocks only on a CPU without AMX (else AMX tiles,
# which stay in Python).
CASES = [(torch.float32, moe.GROUPED), (torch.float16, moe.LINEAR_BLOCKS)]
if moe.expert_gemm(torch.bfloat16) == moe.LINEAR_BLOCKS:
    CASES.append((torch.bfloat16, moe.LINEAR_BLOCKS))


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _block(dtype: torch.dtype, tokens: int, experts: int, top_k: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, inter = 64, 48

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype)

    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = ops.moe_router(logits, top_k, renormalize=True)
    return {
        "x": rnd(tokens, h),
        "topk_weights": weights,
        "topk_ids": ids,
        "w13": _param(rnd(experts, 2 * inter, h)),
        "w2": _param(rnd(experts, h, inter)),
        "shared_w13": _param(rnd(2 * inter, h)),
        "shared_w2": _param(rnd(h, inter)),
        "shared_gate_w": _param(rnd(1, h)),
    }


def _native(b: dict, kind: str, shared: bool, gate: bool) -> torch.Tensor:
    return NATIVE.moe_combine(
        b["x"], b["topk_weights"], b["topk_ids"], b["w13"], b["w2"],
        b["shared_w13"] if shared else None, b["shared_w2"] if shared else None,
        b["shared_gate_w"] if gate else None, kind, LANES,
    )  # fmt: skip


def _python(b: dict, shared: bool, gate: bool) -> torch.Tensor:
    return ops.moe_combine(
        b["x"], b["topk_weights"], b["topk_ids"], b["w13"], b["w2"],
        shared_w13=b["shared_w13"] if shared else None,
        shared_w2=b["shared_w2"] if shared else None,
        shared_gate_w=b["shared_gate_w"] if gate else None,
    )  # fmt: skip


@pytest.mark.parametrize(("dtype", "kind"), CASES)
@pytest.mark.parametrize("cache", [False, True])
def test_moe_combine_bits_equal_the_python_op(dtype: torch.dtype, kind: str, cache: bool) -> None:
    gemm.enable_packed_weight_cache(cache)
    try:
        for tokens, experts, top_k in [(1, 4, 1), (8, 8, 2), (33, 8, 8), (5, 16, 4)]:
            b = _block(dtype, tokens, experts, top_k, seed=tokens * 100 + experts)
            for shared, gate in [(False, False), (True, False), (True, True)]:
                for threads in (1, 2):
                    with num_threads(threads):
                        got = _native(b, kind, shared, gate)
                        want = _python(b, shared, gate)
                    assert got.dtype == dtype and got.shape == b["x"].shape
                    assert torch.equal(got, want), (tokens, experts, top_k, shared, gate)
    finally:
        gemm.enable_packed_weight_cache(False)


def test_moe_combine_routes_past_the_local_experts_as_the_python_op() -> None:
    """A slot routed to an expert this weight does not hold (the expert-parallel branch of
    `moe_experts`): -0.0, as in Python, and the same bits."""
    b = _block(torch.float32, 6, 8, 2, seed=7)
    b["w13"], b["w2"] = _param(b["w13"][:5].clone()), _param(b["w2"][:5].clone())
    b["topk_ids"] = b["topk_ids"] % 7  # some ids >= 5
    assert int(b["topk_ids"].max()) >= 5
    assert torch.equal(_native(b, moe.GROUPED, True, True), _python(b, True, True))


def test_negative_controls() -> None:
    """The comparison can fail: another routing of the same tokens, or the other expert GEMM
    for the same fp32 operands, give other bits."""
    b = _block(torch.float32, 16, 8, 2, seed=11)
    base = _native(b, moe.GROUPED, True, True)
    other = dict(b, topk_ids=(b["topk_ids"] + 1) % 8)
    assert not torch.equal(base, _native(other, moe.GROUPED, True, True))
    assert not torch.equal(base, _native(b, moe.LINEAR_BLOCKS, True, True))


def test_refusals_are_loud() -> None:
    b = _block(torch.float32, 4, 4, 2, seed=3)
    with pytest.raises(RuntimeError, match="does not run here"):
        _native(b, moe.AMX_TILES, False, False)
    with pytest.raises(RuntimeError, match="lanes"):
        NATIVE.moe_combine(
            b["x"], b["topk_weights"], b["topk_ids"], b["w13"], b["w2"], None, None, None,
            moe.GROUPED, 4,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="do not multiply"):
        NATIVE.moe_combine(
            b["x"][:, :32], b["topk_weights"], b["topk_ids"], b["w13"], b["w2"], None, None,
            None, moe.GROUPED, LANES,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="one row per token"):
        NATIVE.moe_combine(
            b["x"][None], b["topk_weights"], b["topk_ids"], b["w13"], b["w2"], None, None,
            None, moe.GROUPED, LANES,
        )  # fmt: skip
