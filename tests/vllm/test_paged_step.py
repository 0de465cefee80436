"""The CPU attention backend's per-step query positions (#37): computed by a step's first
layer, reused by the others, recomputed for the next step; the bits of the per-layer path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from isoexec import ops
from isoexec.vllm.paged_attention import paged_forward

H, HKV, D, BS = 4, 2, 32, 16


def _step(lens: list[int], qlens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """A vLLM-shaped step: cache [blocks, Hkv, block_size, 2D], query [T, H, D] with 2 padding
    rows, and the metadata tensors."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // BS) for n in lens) + 1
    kv = torch.randn(nb, HKV, BS, 2 * D, generator=g)
    bt = torch.zeros(len(lens), -(-max(lens) // BS), dtype=torch.int32)
    used = 1
    for r, n in enumerate(lens):
        for j in range(-(-n // BS)):
            bt[r, j], used = used, used + 1
    q = torch.randn(sum(qlens) + 2, H, D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kv, bt, torch.tensor(lens, dtype=torch.int32), qsl


def _metadata(bt: torch.Tensor, sl: torch.Tensor, qsl: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(
        num_actual_tokens=int(qsl[-1]), block_table=bt, seq_lens=sl, query_start_loc=qsl
    )


class _CountingOps:
    """The torch backend's attention functions, counting `paged_queries` calls."""

    def __init__(self) -> None:
        self.plans = 0
        self.attention_paged = ops.attention_paged

    def paged_queries(self, *a: torch.Tensor) -> ops.attention.PagedQueries:
        self.plans += 1
        return ops.paged_queries(*a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_step_path_has_the_bits_and_plans_once_per_step(dtype: torch.dtype) -> None:
    counting = _CountingOps()
    for step, (lens, qlens) in enumerate([([40, 7, 130], [1, 7, 1]), ([41, 8, 131], [1, 1, 1])]):
        q, kv, bt, sl, qsl = _step(lens, qlens, seed=step)
        q, kv = q.to(dtype), kv.to(dtype)
        md = _metadata(bt, sl, qsl)
        for layer in range(3):  # three layers of one step share vLLM's metadata object
            ref = torch.full((q.shape[0], H * D), 7.0, dtype=dtype)
            ops_ref = SimpleNamespace(attention_paged=ops.attention_paged)
            paged_forward(ops_ref, q, kv, md, ref, D**-0.5)
            got = torch.full_like(ref, 7.0)
            paged_forward(counting, q, kv, md, got, D**-0.5, per_step=True)
            assert torch.equal(got, ref), (step, layer)
            assert torch.equal(got[-2:], torch.full_like(got[-2:], 7.0))  # padding untouched
        assert counting.plans == step + 1  # once per step, not per layer
