"""The engine's KV cache write (`isoexec.vllm.attention.write_cache`): the compiled byte copy
stores exactly what the torch write stores, padding slots skipped, and a slot past the cache
is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from isoexec.vllm.attention import write_cache

BLOCKS, HEADS, BLOCK, D = 6, 2, 16, 64


def _torch_write(cache, key, value, slots):
    nb, h, bs, two_d = cache.shape
    kv = cache.view(nb, h, bs, 2, two_d // 2)
    keep = slots >= 0
    s, k, v = slots[keep].long(), key[: slots.shape[0]][keep], value[: slots.shape[0]][keep]
    kv[s // bs, :, s % bs, 0] = k.to(kv.dtype)
    kv[s // bs, :, s % bs, 1] = v.to(kv.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_copy_stores_what_the_torch_write_stores(dtype):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(12, 3 * HEADS * D, generator=g).to(dtype)  # vLLM's split views
    key = qkv[:, HEADS * D : 2 * HEADS * D].view(12, HEADS, D)
    value = qkv[:, 2 * HEADS * D :].view(12, HEADS, D)
    assert not key.is_contiguous()
    slots = torch.tensor([5, 17, -1, 40, 95, 3, -1, 64, 81, 16, 0, 33])[:10]  # 2 rows unused
    ours = torch.randn(BLOCKS, HEADS, BLOCK, 2 * D, generator=g).to(dtype)
    want = ours.clone()
    write_cache(ours, key, value, slots)
    _torch_write(want, key, value, slots)
    assert torch.equal(ours, want)
    before = ours.clone()
    write_cache(ours, key, value, torch.full((10,), -1))  # all padding: nothing written
    assert torch.equal(ours, before)


def test_a_slot_past_the_cache_is_refused_and_nothing_written():
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * D)
    key = value = torch.ones(3, HEADS, D)
    with pytest.raises(RuntimeError, match="slot past the cache"):
        write_cache(cache, key, value, torch.tensor([1, 2, BLOCKS * BLOCK]))
    assert not cache.any()


def test_other_dtypes_take_the_converting_torch_write():
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * D, dtype=torch.bfloat16)
    key = torch.randn(4, HEADS, D)  # fp32 into a bf16 cache: converted, as torch converts
    want = cache.clone()
    write_cache(cache, key, key, torch.tensor([0, 1, 2, 3]))
    _torch_write(want, key, key, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(cache, want) and cache.any()


def test_fewer_key_rows_than_slots_never_reach_the_copy():
    """The copy reads one key and value row per slot: with fewer rows it would read past
    them. Such a call takes the torch write, which refuses it (a shape mismatch)."""
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * D)
    key = value = torch.ones(2, HEADS, D)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        write_cache(cache, key, value, torch.tensor([1, 2, 3]))
