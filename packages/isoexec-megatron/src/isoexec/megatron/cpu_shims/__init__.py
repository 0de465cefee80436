"""Every patch Megatron-core 0.16.1 needs to build and run a model on a CPU-only torch.

Megatron assumes CUDA in a handful of places (it moves tensors to
`torch.cuda.current_device()`, allocates buffers with `device="cuda"`, seeds the CUDA RNG) and
compiles a few helpers with `torch.compile`. IsoExec's CPU tests, and CPU trainer-side checks,
need a real Megatron model, so each assumption is undone here by one small, named shim.

Rules:
- Nothing is patched on import. `apply_cpu_shims()` applies them all, explicitly; it is
  idempotent and returns the names of the shims now in force, so callers can report them.
- Scoped to the models that need them. Most shims patch code only Megatron's own (native)
  modules reach: its RoPE module, its causal masks, its router gating, its local norm, its
  `GatedDeltaNet` (`NATIVE_MODEL_SHIMS`). An IsoExec model's canonical modules replace each of
  them, so `megatron_parallel()` applies only the process shims (`apply_process_cpu_shims`:
  the CUDA RNG and buffers, Megatron's TP mappings and pipeline on the CPU, `jit_fuser`), and
  `build_model(isoexec=False)` adds the native ones when a native model is built. A process
  that builds only IsoExec models runs with the process shims alone.
- Each shim is as narrow as we could make it: it replaces one function or method (or one module
  global) and keeps the upstream behaviour apart from the device.
- Shims are for a CPU-only process. `apply_cpu_shims()` refuses to run when CUDA is available,
  so a GPU trainer never silently runs with them.
- Three of them are not about the CPU but about what Megatron's *local* modules (no Transformer
  Engine, no flash-linear-attention) lack on any device: `DEPENDENCY_SHIMS`, each with its
  reason. `apply_dependency_shims()` applies just those, CUDA or not, each only where the
  dependency it stands in for is absent; `megatron_parallel(device="cuda")` applies them and no
  other. They matter only to native (stock Megatron) models: an IsoExec model's sites are the
  canonical modules, which reach none of the patched code (`IsoTopKRouter.forward` never calls
  `Router.gating`, `IsoRMSNorm` / `IsoGatedRMSNorm` replace `WrappedTorchNorm`,
  `IsoGatedDeltaNet` replaces `GatedDeltaNet`). Every other shim is about the CPU device alone
  (CUDA allocations, the CUDA RNG, `torch.compile` building C++ on a CPU) and stays CPU-only.
- The version is pinned: a different megatron-core is refused, because every replacement below
  copies 0.16.1 code and would drift silently otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from isoexec.megatron.cpu_shims.gdn import (
    ZeroCenteredTorchRMSNorm,
    _hf_l2norm,
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
from isoexec.megatron.patches import REGISTRY

SUPPORTED_MEGATRON_VERSION = "0.16.1"

# Each shim is one patch of `isoexec.contract.patch_table`, applied through the trainer's
# `PatchRegistry` (`isoexec.megatron.patches.REGISTRY`), which can undo it.
PATCH_OF = {
    "shim_disable_jit_fuser": "jit_fuser",
    "shim_rotary_embedding_stays_on_cpu": "rotary_embedding_cpu",
    "shim_global_memory_buffer_on_cpu": "global_memory_buffer_cpu",
    "shim_causal_masks_on_cpu": "causal_masks_cpu",
    "shim_router_gating_on_cpu": "router_gating_cpu",
    "shim_moe_utils_without_te": "moe_utils_without_te",
    "shim_cpu_rng_tracker": "cpu_rng_tracker",
    "shim_tp_mappings_on_cpu": "tp_mappings_cpu",
    "shim_torch_norm_zero_centered_gamma": "torch_norm_zero_centered_gamma",
    "shim_gated_delta_net_without_fla": "gated_delta_net_without_fla",
    "shim_gated_delta_net_on_cpu": "gated_delta_net_cpu",
    "shim_pipeline_on_cpu": "pipeline_cpu",
}
_SHIM_OF = {patch: shim for shim, patch in PATCH_OF.items()}


def _apply(shim: Callable[[], None], *, rerun: bool = False) -> None:
    REGISTRY.apply(PATCH_OF[shim.__name__], shim, rerun=rerun)


def _applied() -> list[str]:
    """The shims in force, in application order (by their function names)."""
    return [_SHIM_OF[p] for p in REGISTRY.applied() if p in _SHIM_OF]


def undo_cpu_shims() -> None:
    """Put Megatron back as it was before any shim (every write each shim made, undone)."""
    for patch in reversed(REGISTRY.applied()):
        if patch in _SHIM_OF:
            REGISTRY.undo(patch)


def _check_environment() -> None:
    """Refuse to patch a CUDA process or a megatron-core these shims were not written for."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "apply_cpu_shims() is for CPU-only processes, but CUDA is available; "
            "the shims would move Megatron's CUDA buffers onto the CPU."
        )
    _check_version()


def _check_version() -> None:
    """Refuse a megatron-core the shims were not written for (they copy 0.16.1 code)."""
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

# Shims that only Megatron's own modules reach (the native arms): applied when a native model
# is built. An IsoExec model has no Megatron RoPE module (RoPE is canonical in the core
# attention), passes no attention mask (its core attention takes packed boundaries), never
# calls `Router.gating` (`IsoTopKRouter`), and replaces `WrappedTorchNorm` and `GatedDeltaNet`.
NATIVE_MODEL_SHIMS: frozenset[str] = frozenset(
    {
        "shim_rotary_embedding_stays_on_cpu",
        "shim_causal_masks_on_cpu",
        "shim_router_gating_on_cpu",
        "shim_moe_utils_without_te",
        "shim_torch_norm_zero_centered_gamma",
        "shim_gated_delta_net_without_fla",
        "shim_gated_delta_net_on_cpu",
    }
)

# Shims that must be re-run when more Megatron modules have been imported since.
_RERUNNABLE = {"shim_disable_jit_fuser"}


def apply_cpu_shims(*, native_models: bool = True) -> list[str]:
    """Apply the CPU shims (idempotent) and return the names of those in force: all of them,
    or with `native_models=False` the process shims only (not `NATIVE_MODEL_SHIMS`).

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
        if native_models or shim.__name__ not in NATIVE_MODEL_SHIMS:
            _apply(shim, rerun=shim.__name__ in _RERUNNABLE)
    return applied_cpu_shims()


def apply_process_cpu_shims() -> list[str]:
    """The CPU shims any Megatron model on the CPU needs (what `megatron_parallel()` applies):
    every shim but `NATIVE_MODEL_SHIMS`. Idempotent; returns the names in force."""
    return apply_cpu_shims(native_models=False)


def applied_cpu_shims() -> list[str]:
    """Names of the shims applied in this process, in application order."""
    return _applied()


# --------------------------------------------------------------------------------------------
# Dependency shims: what Megatron's local modules lack on any device (CUDA included)
# --------------------------------------------------------------------------------------------


def _te_absent() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not getattr(moe_utils, "HAVE_TE", False)


def _fla_absent() -> bool:
    from megatron.core.ssm import gated_delta_net as gdn

    # HAVE_FLA is also True once the shim bound its torch stand-ins (then re-running is a no-op).
    return not gdn.HAVE_FLA or getattr(gdn, "l2norm", None) is _hf_l2norm()


def _always() -> bool:
    return True


# (shim, when it applies, why a CUDA process needs it too). Each is defined, with its full
# reason, beside the CPU shims (`transformer.py`, `gdn.py`).
DEPENDENCY_SHIMS: tuple[tuple[Callable[[], None], Callable[[], bool], str], ...] = (
    (
        shim_moe_utils_without_te,
        _te_absent,
        "without Transformer Engine, Megatron's router gating (`RouterGatingLinearFunction`) "
        "reads the unbound name `te_general_gemm`: native MoE models raise NameError on any "
        "device",
    ),
    (
        shim_torch_norm_zero_centered_gamma,
        _always,
        "Megatron's local norm (`WrappedTorchNorm`, what native specs build whether or not TE "
        "is installed) refuses `layernorm_zero_centered_gamma`: native GDN hybrids need it on "
        "any device",
    ),
    (
        shim_gated_delta_net_without_fla,
        _fla_absent,
        "without flash-linear-attention, Megatron's `GatedDeltaNet` refuses to construct: "
        "native GDN layers get Megatron's own torch chunked delta rule and HF's l2norm on any "
        "device",
    ),
)


def apply_dependency_shims() -> list[str]:
    """Apply the shims of `DEPENDENCY_SHIMS` whose dependency is absent (idempotent), CUDA or
    not, and return the names of those in force. The other shims are CPU-only
    (`apply_cpu_shims`, which applies these too)."""
    _check_version()
    import megatron.core.ssm.gated_delta_net
    import megatron.core.transformer.moe.moe_utils
    import megatron.core.transformer.torch_norm  # noqa: F401

    for shim, applies, _why in DEPENDENCY_SHIMS:
        if shim.__name__ in _applied() or not applies():
            continue
        _apply(shim)
    return [name for name in _applied() if name in _dependency_names()]


def applied_cpu_only_shims() -> list[str]:
    """The CPU-only shims applied in this process (those not in `DEPENDENCY_SHIMS`): a process
    holding any of them has Megatron allocating on the CPU and cannot host a CUDA trainer."""
    return [name for name in _applied() if name not in _dependency_names()]


def _dependency_names() -> set[str]:
    return {shim.__name__ for shim, _, _ in DEPENDENCY_SHIMS}


__all__ = [
    "DEPENDENCY_SHIMS",
    "NATIVE_MODEL_SHIMS",
    "PATCH_OF",
    "SUPPORTED_MEGATRON_VERSION",
    "ZeroCenteredTorchRMSNorm",
    "applied_cpu_only_shims",
    "applied_cpu_shims",
    "apply_cpu_shims",
    "apply_dependency_shims",
    "apply_process_cpu_shims",
    "model_parallel_cpu_manual_seed",
    "reset_cpu_rng_tracker",
    "undo_cpu_shims",
]
