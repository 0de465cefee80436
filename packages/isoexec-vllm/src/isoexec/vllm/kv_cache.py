"""IsoExec's KV cache layout, shared by the CPU and CUDA attention backends.

Both keep vLLM's cache shape `[num_blocks, kv_heads, block_size, 2 * head_dim]`, with row
(block, head, slot) holding `K[tok] | V[tok]` verbatim, and hand the canonical paged attention
strided views of it: nothing is copied per layer call, whatever the physical strides.
"""

from __future__ import annotations

import torch


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views `[num_blocks, block_size, kv_heads, head_dim]` of the cache."""
    head_dim = kv_cache.shape[-1] // 2
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_dim], kv[..., head_dim:]


__all__ = ["cache_views"]
