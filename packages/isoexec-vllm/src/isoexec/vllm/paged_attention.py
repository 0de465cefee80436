"""IsoExec's paged KV cache layout and the canonical paged forward, shared by the CPU and CUDA
attention backends.

Both keep vLLM's cache shape `[num_blocks, kv_heads, block_size, 2 * head_dim]`, with row
(block, head, slot) holding `K[tok] | V[tok]` verbatim, and hand the canonical paged attention
strided views of it: nothing is copied per layer call, whatever the physical strides.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views `[num_blocks, block_size, kv_heads, head_dim]` of the cache."""
    head_dim = kv_cache.shape[-1] // 2
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_dim], kv[..., head_dim:]


def paged_forward(
    ops: ModuleType | Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: Any,
    output: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The canonical paged attention of a step's real tokens, written into vLLM's `output`
    (padded rows left as they are): each backend's forward after its own checks."""
    n = metadata.num_actual_tokens
    k_cache, v_cache = cache_views(kv_cache)
    out = ops.attention_paged(
        query[:n],
        k_cache,
        v_cache,
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale=scale,
    )
    output[:n] = out.reshape(output[:n].shape).to(output.dtype)
    return output


__all__ = ["cache_views", "paged_forward"]
