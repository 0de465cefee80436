"""The MoE block (router, grouped experts, combine) captured in a real CUDA graph and replayed
with new routing. GPU only: CPU vLLM captures no graphs, and on CPU `test_graph_safety.py`'s
capture guard stands in for capture (it raises on the host syncs that would break it)."""

from __future__ import annotations

import pytest
import torch
from _triton_testlib import CUDA, HAVE_TRITON

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="a real CUDA graph needs a CUDA GPU"),
]

from isoexec.ops import triton as xops  # noqa: E402


def _x(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to("cuda")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def test_moe_block_replays_in_a_cuda_graph_with_new_routing() -> None:
    """Captured once, replayed with other routing: the same bits as eager for that routing."""
    t, h = 16, 64
    x = _x(t, h, seed=1, dtype=torch.bfloat16)
    w13 = _x(8, 96, h, seed=3, dtype=torch.bfloat16, scale=0.1)
    w2 = _x(8, h, 48, seed=4, dtype=torch.bfloat16, scale=0.1)
    logits = _x(t, 8, seed=5)
    static_logits = logits.clone()

    def block() -> torch.Tensor:
        w, ids = xops.moe_router(static_logits, 2, renormalize=True)
        return xops.moe_combine(x, w, ids, w13, w2)

    block()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    for seed in (6, 7):
        static_logits.copy_(_x(t, 8, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(out, block())
