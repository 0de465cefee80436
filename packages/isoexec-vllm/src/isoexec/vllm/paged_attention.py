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


def step_queries(ops: ModuleType | Any, metadata: Any) -> Any:
    """The step's `paged_queries`, computed by its first attention layer and kept on vLLM's
    metadata object, which is built anew each step and shared by the layers of a KV-cache
    group: the others reuse it (#37: recomputing it per layer cost as much as the kernel)."""
    queries = getattr(metadata, "_isoexec_queries", None)
    if queries is None:
        queries = ops.paged_queries(
            metadata.block_table, metadata.seq_lens, metadata.query_start_loc
        )
        metadata._isoexec_queries = queries
    return queries


def paged_forward(
    ops: ModuleType | Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: Any,
    output: torch.Tensor,
    scale: float,
    *,
    per_step: bool = False,
) -> torch.Tensor:
    """The canonical paged attention of a step's real tokens, written into vLLM's `output`
    (padded rows left as they are): each backend's forward after its own checks.

    `per_step` (the CPU backend): the query positions come from `step_queries` and the
    kernel writes into `output` itself."""
    n = metadata.num_actual_tokens
    k_cache, v_cache = cache_views(kv_cache)
    args = (query[:n], k_cache, v_cache, metadata.block_table, metadata.seq_lens)
    if per_step and query.dtype == output.dtype:
        rows = output[:n].view(n, query.shape[1], v_cache.shape[-1])
        ops.attention_paged(
            *args,
            metadata.query_start_loc,
            scale=scale,
            queries=step_queries(ops, metadata),
            out=rows,
        )
        return output
    out = ops.attention_paged(*args, metadata.query_start_loc, scale=scale)
    output[:n] = out.reshape(output[:n].shape).to(output.dtype)
    return output


__all__ = ["cache_views", "paged_forward", "step_queries"]
