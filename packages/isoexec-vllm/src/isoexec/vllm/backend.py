"""Which canonical variant and kernel backend this engine's sites run.

The options travel as vLLM's `additional_config["isoexec"]` (its extension point for plugin
settings), so they reach every worker process with the rest of vLLM's config. Sites read them
when vLLM constructs them (vLLM's config is current then) and keep the ops module and the
`ImplInfo` they bound: what a site records is what it calls.
"""

from __future__ import annotations

from typing import Any

from isoexec import ops
from isoexec.contract.impl import ImplInfo
from isoexec.contract.options import VLLM_ADDITIONAL_CONFIG_KEY, IsoExecOptions
from isoexec.vllm.compiled_ops import CompiledOps


def engine_options() -> IsoExecOptions:
    """The IsoExec options of the vLLM engine being built (defaults outside one)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    extra = getattr(cfg, "additional_config", None) or {}
    return IsoExecOptions.from_mapping(extra.get(VLLM_ADDITIONAL_CONFIG_KEY))


def engine_ops() -> CompiledOps:
    """The engine backend's ops (`isoexec.ops` or its Triton twin), with the calls
    made inside vLLM's compiled model as opaque custom ops (`compiled_ops`)."""
    return CompiledOps(engine_options().backend)


def engine_impl(op: str, **params: object) -> ImplInfo:
    """What a site running `op` on the engine's backend records (for a GEMM op, the library
    for the device and dtype the engine builds its model on and in, `engine_placement`; for
    an op whose algorithm depends on them, the one that runs there)."""
    where = engine_placement() if ops.depends_on_placement(op) else {}
    return ops.get_backend_impl(op, engine_options().backend, **where, **params)


def engine_placement() -> dict[str, Any]:
    """The device and dtype of the vLLM engine being built (vLLM builds the model there and
    never moves it). Refused outside one: a GEMM site's library would be a guess."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is None or cfg.model_config is None:
        raise RuntimeError(
            "a canonical GEMM site built outside a vLLM engine's config: its device and dtype "
            "(hence its GEMM library) are unknown"
        )
    return {"device": cfg.device_config.device_type, "dtype": cfg.model_config.dtype}


__all__ = ["engine_impl", "engine_ops", "engine_options", "engine_placement"]
