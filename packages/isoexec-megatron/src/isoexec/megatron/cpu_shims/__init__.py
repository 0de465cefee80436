"""Every patch Megatron-core 0.16.1 needs to build and run a model on a CPU-only torch.

Megatron assumes CUDA in a handful of places (it moves tensors to
`torch.cuda.current_device()`, allocates buffers with `device="cuda"`, seeds the CUDA RNG) and
compiles a few helpers with `torch.compile`. IsoExec's CPU tests, and CPU trainer-side checks,
need a real Megatron model, so each assumption is undone here by one small, named shim.

Rules:
- Nothing is patched on import. `apply_cpu_shims()` applies them all, explicitly; it is
  idempotent and returns the names of the shims now in force, so callers can report them.
- Each shim is as narrow as we could make it: it replaces one function or method (or one module
  global) and keeps the upstream behaviour apart from the device.
- Shims are for a CPU-only process. `apply_cpu_shims()` refuses to run when CUDA is available,
  so a GPU trainer never silently runs with them.
- The version is pinned: a different megatron-core is refused, because every replacement below
  copies 0.16.1 code and would drift silently otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from isoexec.megatron.cpu_shims.gdn import (
    ZeroCenteredTorchRMSNorm,
    shim_gated_delta_net_on_cpu,
    shim_gated_delta_net_without_fla,
    shim_torch_norm_zero_centered_gamma,
)
from isoexec.megatron.cpu_shims.transformer import (
    model_parallel_cpu_manual_seed,
    reset_cpu_rng_tracker,
    shim_causal_masks_on_cpu,
    shim_cpu_rng_tracker,
    shim_disable_jit_fuser,
    shim_global_memory_buffer_on_cpu,
    shim_moe_utils_without_te,
    shim_pipeline_on_cpu,
    shim_rotary_embedding_stays_on_cpu,
    shim_router_gating_on_cpu,
    shim_tp_mappings_on_cpu,
)

SUPPORTED_MEGATRON_VERSION = "0.16.1"

_APPLIED: list[str] = []


def _check_environment() -> None:
    """Refuse to patch a CUDA process or a megatron-core these shims were not written for."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "apply_cpu_shims() is for CPU-only processes, but CUDA is available; "
            "the shims would move Megatron's CUDA buffers onto the CPU."
        )
    from megatron.core import package_info

    if package_info.__version__ != SUPPORTED_MEGATRON_VERSION:
        raise RuntimeError(
            f"isoexec.megatron.cpu_shims was written for megatron-core "
            f"{SUPPORTED_MEGATRON_VERSION}, found {package_info.__version__}; review the shims."
        )


# --------------------------------------------------------------------------------------------

_SHIMS: tuple[Callable[[], None], ...] = (
    shim_disable_jit_fuser,
    shim_rotary_embedding_stays_on_cpu,
    shim_global_memory_buffer_on_cpu,
    shim_causal_masks_on_cpu,
    shim_router_gating_on_cpu,
    shim_moe_utils_without_te,
    shim_cpu_rng_tracker,
    shim_tp_mappings_on_cpu,
    shim_torch_norm_zero_centered_gamma,
    shim_gated_delta_net_without_fla,
    shim_gated_delta_net_on_cpu,
    shim_pipeline_on_cpu,
)

# Shims that must be re-run when more Megatron modules have been imported since.
_RERUNNABLE = {"shim_disable_jit_fuser"}


def apply_cpu_shims() -> list[str]:
    """Apply every CPU shim (idempotent) and return the names of those in force.

    Imports the Megatron modules the shims patch first, so later imports find them patched.
    """
    _check_environment()
    # Import what we patch (and what holds `jit_fuser`s) before patching, so nothing is missed.
    import megatron.core.fusions.fused_softmax
    import megatron.core.models.gpt.gpt_model
    import megatron.core.ssm.gated_delta_net
    import megatron.core.transformer.moe.experts
    import megatron.core.transformer.moe.moe_layer
    import megatron.core.transformer.moe.router
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401

    for shim in _SHIMS:
        if shim.__name__ in _APPLIED and shim.__name__ not in _RERUNNABLE:
            continue
        shim()
        if shim.__name__ not in _APPLIED:
            _APPLIED.append(shim.__name__)
    return applied_cpu_shims()


def applied_cpu_shims() -> list[str]:
    """Names of the shims applied in this process, in application order."""
    return list(_APPLIED)


__all__ = [
    "SUPPORTED_MEGATRON_VERSION",
    "ZeroCenteredTorchRMSNorm",
    "applied_cpu_shims",
    "apply_cpu_shims",
    "model_parallel_cpu_manual_seed",
    "reset_cpu_rng_tracker",
]
