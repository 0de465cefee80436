"""Set up and tear down torch.distributed + Megatron `parallel_state` for a CPU trainer process.

Megatron modules read their tensor-parallel group from `parallel_state` when they are built, so
a model can only exist inside an initialised parallel state. On CPU the backend is gloo.

- A single process (no `WORLD_SIZE` in the environment) gets a world of size 1 over an in-memory
  store: no port, no rendezvous, nothing to leak between tests.
- Several processes (e.g. launched by `torchrun`, which sets `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/
  `MASTER_PORT`) rendezvous through `env://`, so TP>1 on CPU uses the same code path.

`megatron_parallel()` owns what it creates and destroys exactly that on exit, so tests and
scripts never leave a process group (or a seeded RNG tracker) behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from isoexec.megatron.cpu_shims import (
    apply_cpu_shims,
    model_parallel_cpu_manual_seed,
    reset_cpu_rng_tracker,
)


@dataclass(frozen=True)
class ParallelInfo:
    """What `megatron_parallel` set up: the layout and the CPU shims in force."""

    world_size: int
    rank: int
    tp: int
    pp: int
    ep: int
    backend: str
    shims: tuple[str, ...]
    owns_process_group: bool


def _init_process_group(backend: str) -> bool:
    """Initialise the default process group if needed; True when we created it."""
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise RuntimeError(
                f"torch.distributed is already initialised with backend "
                f"{dist.get_backend()!r}; the CPU trainer needs {backend!r}"
            )
        return False
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


@contextmanager
def megatron_parallel(
    tp: int = 1, *, pp: int = 1, ep: int = 1, seed: int = 1234, device: str = "cpu"
) -> Iterator[ParallelInfo]:
    """Context manager: torch.distributed (gloo) + Megatron parallel_state with TP=`tp`,
    PP=`pp`; the rest of the world is data parallel, and expert parallel (EP=`ep`) within
    it, as Megatron lays it out.

    On entry it applies the CPU shims (explicitly, here, because every Megatron model built
    inside needs them), initialises the process group if none exists, initialises
    `parallel_state` and seeds the model-parallel RNG streams. On exit it destroys the parallel
    state, the RNG tracker, and the process group if it created it. Nesting is refused: Megatron's
    parallel state is process-global.
    """
    if device != "cpu":
        raise NotImplementedError(
            f"megatron_parallel(device={device!r}): only the CPU (gloo) path exists so far; "
            "GPU trainers initialise NCCL + model_parallel_cuda_manual_seed themselves"
        )
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel_state is already initialised; megatron_parallel() cannot nest"
        )
    shims = tuple(apply_cpu_shims())
    owns = _init_process_group("gloo")
    try:
        world = dist.get_world_size()
        if tp < 1 or pp < 1 or world % (tp * pp) != 0:
            raise ValueError(f"tp={tp} x pp={pp} must be >= 1 and divide the world size {world}")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            # Experts whole on every TP rank: the canonical MoE combine runs on whole experts.
            expert_tensor_parallel_size=1,
        )
        try:
            model_parallel_cpu_manual_seed(seed)
            yield ParallelInfo(
                world_size=world,
                rank=dist.get_rank(),
                tp=tp,
                pp=pp,
                ep=ep,
                backend="gloo",
                shims=shims,
                owns_process_group=owns,
            )
        finally:
            reset_cpu_rng_tracker()
            ps.destroy_model_parallel()
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["ParallelInfo", "megatron_parallel"]
