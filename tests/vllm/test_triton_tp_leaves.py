"""The engine's TP-invariant row-parallel method on the Triton backend, without an engine: it
records the Triton `linear_tp` impl (the trainer's), and at TP>1 its opaque compiled op calls
the Triton twin's `linear_tp_shard` with vLLM's exact leaf gather. No kernel launches here (no
interpreter in this process): the Triton function is spied and answered by the torch op; the
Triton kernels' own bits and gradients are tests/triton's (`test_kernels.py`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import vllm.config

from isoexec import ops
from isoexec.ops.triton import get_triton_impl
from isoexec.ops.triton.selfcheck_harness import in_order_gather
from isoexec.vllm import collectives, layers


def test_triton_tp_invariant_method_records_and_calls_the_triton_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = SimpleNamespace(
        additional_config={"isoexec": {"backend": "triton", "tp_invariant": True}},
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(dtype=torch.float32),
    )
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: engine)
    method = layers.CanonicalTPInvariantLinearMethod()
    assert method.isoexec_impl == get_triton_impl("linear_tp", leaves=8)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(24, 64, generator=g)
    bias = torch.randn(24, generator=g)
    shards = zip(x.chunk(2, -1), w.chunk(2, -1), strict=True)
    parts = [ops.tp_leaf_partials(a, b, leaves=4) for a, b in shards]
    calls: list[Any] = []

    def spy(xs: torch.Tensor, ws: torch.Tensor, b: Any, *, tp: int, all_gather: Any) -> Any:
        calls.append((tp, all_gather))
        return ops.linear_tp_shard(xs, ws, b, tp=tp, all_gather=in_order_gather(parts, 0))

    monkeypatch.setattr(ops.backend_ops("triton"), "linear_tp_shard", spy)
    out = method.apply(SimpleNamespace(tp_size=2, weight=w[:, :32]), x[:, :32], bias)
    assert calls == [(2, collectives.gather_leaves)]
    assert torch.equal(out, ops.linear_tp_invariant(x, w, bias))
