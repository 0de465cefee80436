"""The fp32 GEMM's prepacked-weight cache: off by default, explicit clear after `.data` writes."""

from __future__ import annotations

import torch

from isoexec import ops
from isoexec.ops import gemm


def test_cache_off_by_default_sees_data_writes() -> None:
    assert not gemm._PACK_CACHE_ENABLED
    w = torch.nn.Parameter(torch.randn(64, 48))
    x = torch.randn(3, 48)
    y0 = ops.linear(x, w)
    w.data.copy_(torch.randn(64, 48))  # a write that does not bump w._version
    y1 = ops.linear(x, w)
    assert not torch.equal(y0, y1)
    assert torch.equal(y1, ops.linear(x, w.detach().clone()))


def test_enabled_cache_is_stale_until_cleared() -> None:
    """Why the owner must clear: with the cache on, a `.data` write is invisible."""
    gemm.enable_packed_weight_cache()
    try:
        w = torch.nn.Parameter(torch.randn(64, 48))
        x = torch.randn(3, 48)
        y0 = ops.linear(x, w)
        w.data.copy_(torch.randn(64, 48))
        assert torch.equal(ops.linear(x, w), y0)  # stale: the hazard the protocol handles
        gemm.clear_packed_weight_cache()
        assert torch.equal(ops.linear(x, w), ops.linear(x, w.detach().clone()))
        with torch.no_grad():
            w.add_(1.0)  # a normal in-place update bumps _version: repacked without a clear
        assert torch.equal(ops.linear(x, w), ops.linear(x, w.detach().clone()))
    finally:
        gemm.enable_packed_weight_cache(False)


def test_expert_slices_are_cached_per_slice_and_follow_updates() -> None:
    """MoE: `w13[e]` is a view of the stacked parameter; each expert's slice gets its own
    packed weight (reused across calls), and an in-place update of the stack repacks."""
    gemm.enable_packed_weight_cache()
    try:
        w13 = torch.nn.Parameter(torch.randn(4, 64, 48))
        x = torch.randn(5, 48)
        with torch.inference_mode():
            ys = [ops.linear(x, w13[e]) for e in range(4)]
            assert len(gemm._PACK_CACHE) == 4
            packed = {k: v[2] for k, v in gemm._PACK_CACHE.items()}
            again = [ops.linear(x, w13[e]) for e in range(4)]
            assert all(p is gemm._PACK_CACHE[k][2] for k, p in packed.items())  # hits
        for e in range(4):
            assert torch.equal(ys[e], again[e])
            assert torch.equal(ys[e], ops.linear(x, w13[e].detach().clone()))
        assert not torch.equal(ys[0], ys[1])
        with torch.no_grad():
            w13[2].mul_(2.0)  # in-place through a view: the shared version counter moves
        with torch.inference_mode():
            assert torch.equal(ops.linear(x, w13[2]), ops.linear(x, w13[2].detach().clone()))
        del w13
        assert not gemm._PACK_CACHE  # the entries die with the parameter
    finally:
        gemm.enable_packed_weight_cache(False)
