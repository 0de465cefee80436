"""Which canonical variant and kernel backend this engine's sites run.

The options travel as vLLM's `additional_config["isoexec"]` (its extension point for plugin
settings), so they reach every worker process with the rest of vLLM's config. Sites read them
when vLLM constructs them (vLLM's config is current then) and keep one `SiteBinding` per op:
what a site records and what it calls come from the same object.
"""

from __future__ import annotations

from isoexec import ops
from isoexec.contract.impl import ImplInfo
from isoexec.contract.options import VLLM_ADDITIONAL_CONFIG_KEY, IsoExecOptions
from isoexec.ops.binding import Placement, SiteBinding
from isoexec.vllm.compiled_ops import CompiledOps


def engine_options() -> IsoExecOptions:
    """The IsoExec options of the vLLM engine being built (defaults outside one)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    extra = getattr(cfg, "additional_config", None) or {}
    return IsoExecOptions.from_mapping(extra.get(VLLM_ADDITIONAL_CONFIG_KEY))


def engine_binding(
    op: str, *, backend: str | None = None, impl: ImplInfo | None = None, **params: object
) -> SiteBinding:
    """The binding of an engine site running `op` (`isoexec.ops.binding`): the engine's backend
    (or `backend`, for an op only one backend has; `impl`, for an op outside the ops'
    registry), its placement where the op's record
    depends on it, and the backend's ops with the calls made inside vLLM's compiled model as
    opaque custom ops (`compiled_ops`). Record and functions come from the same fields."""
    backend = engine_options().backend if backend is None else backend
    placement = engine_placement() if ops.depends_on_placement(op) else None
    provider = CompiledOps(backend)
    return SiteBinding(
        op, backend=backend, placement=placement, provider=provider, impl=impl, **params
    )


def engine_placement() -> Placement:
    """The device and dtype of the vLLM engine being built (vLLM builds the model there and
    never moves it). Refused outside one: a GEMM site's library would be a guess."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is None or cfg.model_config is None:
        raise RuntimeError(
            "a canonical GEMM site built outside a vLLM engine's config: its device and dtype "
            "(hence its GEMM library) are unknown"
        )
    return Placement(cfg.device_config.device_type, cfg.model_config.dtype)


__all__ = ["engine_binding", "engine_options", "engine_placement"]
