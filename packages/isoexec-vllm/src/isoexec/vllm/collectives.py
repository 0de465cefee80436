"""The engine's exact collectives for canonical ops (vLLM's own, in rank order).

Apart from the layers and the compiled ops that use them, so neither imports the other.
"""

from __future__ import annotations

import torch


def gather_leaves(parts: torch.Tensor) -> torch.Tensor:
    """[G/tp, M, N] on each rank -> [G, M, N] in rank order (vLLM's exact all-gather)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(parts.contiguous(), dim=0)


__all__ = ["gather_leaves"]
