"""`torch.ops.isoexec_cpu.paged_attention` (`cpu_kernels/torch_ops_attention.cpp`) against the
Python step it stands in for in the CPU engine (`isoexec.vllm.paged_attention.paged_forward`,
per step): the same bits in vLLM's output rows for decode, prefill, chunked prefill and mixed
steps, padded rows zeroed, fp32 and bf16; negative controls: other sequence lengths or scale
give other bits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from isoexec import ops
from isoexec.ops import cpu_torch_ops
from isoexec.ops.attention import DEFAULT_LANES
from isoexec.vllm.paged_attention import paged_forward
from tests._support.threads import num_threads

cpu_torch_ops.load()
NATIVE = torch.ops.isoexec_cpu
H, HKV, D, BS = 4, 2, 64, 16


def _step(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, pad: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-s // BS) for s in seq_lens) + 2
    kv_cache = torch.randn(blocks, HKV, BS, 2 * D, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).to(torch.int32)  # blocks scattered
    width = max(-(-s // BS) for s in seq_lens) + 1
    table = torch.zeros(len(seq_lens) + 1, width, dtype=torch.int32)  # one spare row
    used = 0
    for r, s in enumerate(seq_lens):
        n = -(-s // BS)
        table[r, :n] = perm[used : used + n]
        used += n
    n_tokens = sum(q_lens)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    md = SimpleNamespace(
        num_actual_tokens=n_tokens,
        block_table=table,
        seq_lens=torch.tensor([*seq_lens, 0], dtype=torch.int32),  # padded past nreq
        query_start_loc=qsl,
    )
    query = torch.randn(n_tokens + pad, H, D, generator=g).to(dtype)
    return query, kv_cache, md


def _python(query, kv_cache, md, scale):
    out = torch.full((query.shape[0], H * D), 7.0, dtype=query.dtype)
    return paged_forward(ops, query, kv_cache, md, out, scale, per_step=True)


def _native(query, kv_cache, md, scale):
    out = torch.full((query.shape[0], H * D), 7.0, dtype=query.dtype)
    NATIVE.paged_attention(
        query, kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
        md.num_actual_tokens, scale, DEFAULT_LANES, out,
    )  # fmt: skip
    return out


STEPS = {
    "decode": ([1] * 5, [17, 1, 40, 33, 64]),
    "prefill": ([20, 7], [20, 7]),
    "chunked": ([9, 1, 16], [30, 5, 16]),  # a chunk after cached tokens, decode, prefill
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_paged_attention_bits_equal_the_python_step(dtype: torch.dtype, step: str) -> None:
    q_lens, seq_lens = STEPS[step]
    for pad in (0, 3):  # vLLM's padded rows: zeroed by both
        query, kv_cache, md = _step(q_lens, seq_lens, dtype, pad, seed=pad + len(step))
        for threads in (1, 2):
            with num_threads(threads):
                got = _native(query, kv_cache, md, 0.125)
                want = _python(query, kv_cache, md, 0.125)
            assert torch.equal(got, want), (step, pad, threads)
            n = md.num_actual_tokens
            assert torch.equal(got[n:], torch.full_like(got[n:], 7.0))  # past the padded rows
            # the padded query rows (beyond num_actual_tokens) are vLLM's: left as they are


def test_negative_controls() -> None:
    """The comparison can fail: a key more per sequence, or another scale, give other bits."""
    query, kv_cache, md = _step([1, 1], [20, 35], torch.float32, 0, seed=5)
    base = _native(query, kv_cache, md, 0.125)
    assert not torch.equal(base, _native(query, kv_cache, md, 0.126))
    longer = SimpleNamespace(**vars(md))
    longer.seq_lens = md.seq_lens + torch.tensor([1, 1, 0], dtype=torch.int32)
    assert not torch.equal(base, _native(query, kv_cache, longer, 0.125))


def test_refusals_are_loud() -> None:
    query, kv_cache, md = _step([1], [5], torch.float32, 0, seed=1)
    out = torch.empty(1, H * D)
    with pytest.raises(RuntimeError, match="lanes"):
        NATIVE.paged_attention(query, kv_cache, md.block_table, md.seq_lens,
                               md.query_start_loc, 1, 0.1, 4, out)  # fmt: skip
    with pytest.raises(RuntimeError, match="kv_cache"):
        NATIVE.paged_attention(query, kv_cache[0], md.block_table, md.seq_lens,
                               md.query_start_loc, 1, 0.1, DEFAULT_LANES, out)  # fmt: skip
