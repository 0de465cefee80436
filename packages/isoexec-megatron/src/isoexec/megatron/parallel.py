"""Set up and tear down torch.distributed + Megatron `parallel_state` for a trainer process,
on the CPU (gloo) or on CUDA (NCCL).

Megatron modules read their tensor-parallel group from `parallel_state` when they are built, so
a model can only exist inside an initialised parallel state. What differs between the devices
is one `DevicePlan` (`device_plan`): the process-group backend, the shims, the RNG seeding.

- `device="cpu"`: gloo, the process CPU shims (`cpu_shims.apply_process_cpu_shims`; a native
  model's own shims come with `build_model(isoexec=False)`), Megatron's RNG streams
  over the CPU generator (`model_parallel_cpu_manual_seed`); refused when CUDA is available.
- `device="cuda"`: NCCL, `torch.cuda.set_device(LOCAL_RANK)`, Megatron's own
  `model_parallel_cuda_manual_seed`, and no CPU shim: only the dependency shims (what Megatron's
  local modules lack without Transformer Engine / flash-linear-attention, on any device;
  `cpu_shims.DEPENDENCY_SHIMS`), which an IsoExec model never reaches. Refused, before
  anything is created, without CUDA, with LOCAL_RANK beyond the visible devices, or in a
  process where CPU shims are already in force.

The layout in force is `current_layout()`; `build_model` reads its device and builds there
(`use_cpu_initialization` on the CPU only), so a CUDA model is built on its device, never moved.

- A single process (no `WORLD_SIZE` in the environment) gets a world of size 1 over an in-memory
  store: no port, no rendezvous, nothing to leak between tests.
- Several processes (e.g. launched by `torchrun`, which sets `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/
  `MASTER_PORT`) rendezvous through `env://`, so TP>1 on CPU uses the same code path.

`megatron_parallel()` owns what it creates and destroys exactly that on exit, so tests and
scripts never leave a process group (or a seeded RNG tracker) behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from isoexec.megatron.cpu_shims import (
    applied_cpu_only_shims,
    apply_dependency_shims,
    apply_process_cpu_shims,
    model_parallel_cpu_manual_seed,
    reset_cpu_rng_tracker,
)

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ParallelInfo:
    """What `megatron_parallel` set up: the layout, its device and the shims in force."""

    world_size: int
    rank: int
    tp: int
    pp: int
    ep: int
    backend: str
    shims: tuple[str, ...]
    owns_process_group: bool
    device: str = "cpu"


@dataclass(frozen=True)
class DevicePlan:
    """What a trainer on `device` needs: the process-group `backend`, the shims to apply
    (returning the names in force) and the model-parallel RNG seeding."""

    device: str
    backend: str
    apply_shims: Callable[[], list[str]]
    manual_seed: Callable[[int], None]


def _cuda_manual_seed(seed: int) -> None:
    """Megatron's own `model_parallel_cuda_manual_seed` (looked up when called)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(seed)


def device_plan(device: str) -> DevicePlan:
    """The plan for `device` ("cpu" or "cuda"); a pure decision, nothing is applied."""
    if device == "cpu":
        return DevicePlan("cpu", "gloo", apply_process_cpu_shims, model_parallel_cpu_manual_seed)
    if device == "cuda":
        return DevicePlan("cuda", "nccl", apply_dependency_shims, _cuda_manual_seed)
    raise ValueError(f"megatron_parallel(device={device!r}): known devices {list(DEVICES)}")


def local_cuda_device() -> int:
    """This process's CUDA device (torchrun's LOCAL_RANK, 0 alone), after checking that CUDA
    is there, that the device exists and that no CPU shim is in force; nothing is changed."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "megatron_parallel(device='cuda'): CUDA is not available in this process "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); run on a "
            "GPU machine with a CUDA torch, or use device='cpu'"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise RuntimeError(
            f"megatron_parallel(device='cuda'): LOCAL_RANK={local_rank} but {count} CUDA "
            "device(s) are visible; one rank per device"
        )
    cpu_only = applied_cpu_only_shims()
    if cpu_only:
        raise RuntimeError(
            "megatron_parallel(device='cuda'): CPU shims are in force in this process "
            f"({', '.join(cpu_only)}): Megatron would allocate on the CPU; run the CUDA trainer "
            "in a process that never set up a CPU one"
        )
    return local_rank


_CURRENT: list[ParallelInfo] = []  # the layout of the megatron_parallel() in force, if any


def current_layout() -> ParallelInfo | None:
    """The layout `megatron_parallel()` set up and that is still in force; None outside."""
    return _CURRENT[0] if _CURRENT else None


def _init_process_group(backend: str) -> bool:
    """Initialise the default process group if needed; True when we created it."""
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise RuntimeError(
                f"torch.distributed is already initialised with backend "
                f"{dist.get_backend()!r}; this trainer needs {backend!r}"
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
    """Context manager: torch.distributed + Megatron parallel_state with TP=`tp`, PP=`pp`; the
    rest of the world is data parallel, and expert parallel (EP=`ep`) within it, as Megatron
    lays it out. `device` ("cpu": gloo; "cuda": NCCL) chooses the `DevicePlan`.

    On entry it checks the device (CUDA: before anything is created), applies the plan's shims
    (explicitly, here, because every Megatron model built inside needs them), initialises the
    process group if none exists, initialises `parallel_state` and seeds the model-parallel RNG
    streams. On exit it destroys the parallel state, the RNG tracker, and the process group if
    it created it. Nesting is refused: Megatron's parallel state is process-global.
    """
    plan = device_plan(device)
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel_state is already initialised; megatron_parallel() cannot nest"
        )
    if plan.device == "cuda":
        torch.cuda.set_device(local_cuda_device())
    shims = tuple(plan.apply_shims())
    owns = _init_process_group(plan.backend)
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
            plan.manual_seed(seed)
            info = ParallelInfo(
                world_size=world,
                rank=dist.get_rank(),
                tp=tp,
                pp=pp,
                ep=ep,
                backend=plan.backend,
                shims=shims,
                owns_process_group=owns,
                device=plan.device,
            )
            _CURRENT.append(info)
            yield info
        finally:
            _CURRENT.clear()
            reset_cpu_rng_tracker()  # Megatron's tracker globals, whichever device seeded them
            ps.destroy_model_parallel()
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


__all__ = [
    "DEVICES",
    "DevicePlan",
    "ParallelInfo",
    "current_layout",
    "device_plan",
    "local_cuda_device",
    "megatron_parallel",
]
