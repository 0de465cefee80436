"""One engine worker's contract, read back from its live model and sampler.

Used by the worker extension (`isoexec_contract`, on request) and by the served handshake
(`served_handshake`, offered as soon as the worker has loaded its checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from isoexec.contract.contract import Contract
from isoexec.contract.model_contract import contract_for
from isoexec.vllm.admission import ADMISSION, has_admission
from isoexec.vllm.install_state import is_installed
from isoexec.vllm.readback import lora_sites, read_sites


class EngineSettingsError(RuntimeError):
    """The engine runs settings its contract could not describe."""


def checkpoint_config(vllm_config: Any) -> dict[str, Any]:
    """The checkpoint's own config.json (nested as released: the contract names its layout)."""
    return json.loads((Path(vllm_config.model_config.model) / "config.json").read_text())


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in overrides.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _live_value(hf_config: Any, path: tuple[str, ...]) -> Any:
    obj = hf_config
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)
    return obj.to_dict() if hasattr(obj, "to_dict") else obj


def _leaves(d: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for k, v in d.items():
        out += _leaves(v, (*prefix, k)) if isinstance(v, Mapping) else [(*prefix, k)]
    return out


def effective_config(vllm_config: Any) -> dict[str, Any]:
    """The config the engine actually built: the checkpoint's config.json with vLLM's
    `hf_overrides` applied (as vLLM applies them), each overridden value checked against the
    live model config. The contract's model identity is hashed from this, so an engine whose
    config was overridden (`--hf-overrides '{"rms_norm_eps": 0.01}'`) does not MATCH a trainer
    built from the checkpoint: the diff names `model.config_digest`."""
    model_config = vllm_config.model_config
    cfg = checkpoint_config(vllm_config)
    overrides = model_config.hf_overrides or {}
    if callable(overrides):
        raise EngineSettingsError(
            "hf_overrides is a function: the contract cannot record what it changed"
        )
    cfg = _merge(cfg, overrides)
    for path in _leaves(overrides):
        live = _live_value(model_config.hf_config, path)
        want = _live_value(cfg, path)
        if live != want:
            raise EngineSettingsError(
                f"hf_overrides sets {'.'.join(path)}={want!r} but the live model config has "
                f"{live!r}: the contract cannot record the config the engine built"
            )
    return cfg


def _lora_impl(vllm_config: Any) -> Any:
    """The LoRA sites' ImplInfo: the canonical op at the engine's padded rank (its
    `max_lora_rank`), its GEMMs on the library for the engine's device and dtype."""
    from isoexec.ops import get_impl

    return get_impl(
        "lora",
        device=vllm_config.device_config.device_type,
        dtype=vllm_config.model_config.dtype,
        rank=int(vllm_config.lora_config.max_lora_rank),
    )


def speculation_of(vllm_config: Any, sampler: Any, rejection_sampler: Any) -> dict[str, Any]:
    """`contract_for`'s speculation arguments for this engine: its (method, k) when it
    speculates, and whether its verifier is IsoExec's: the model runner's rejection sampler
    when given, else the one built over `sampler` (`IsoRejectionSampler` registers there)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return {"speculative": None}
    from isoexec.vllm.spec_decode import IsoRejectionSampler

    if rejection_sampler is None:
        rejection_sampler = getattr(sampler, "isoexec_rejection_sampler", None)
    return {
        "speculative": (str(spec.method), int(spec.num_speculative_tokens)),
        "canonical_verifier": isinstance(rejection_sampler, IsoRejectionSampler),
    }


def worker_settings(vllm_config: Any) -> dict[str, str]:
    """What this worker runs that a canonical contract declares "invariant" (its speculative
    method and k, its TP degree), offered beside the contract and reported in the verdict
    (`isoexec.handshake.side_settings`)."""
    spec = vllm_config.speculative_config
    speculative = "none" if spec is None else f"{spec.method}/{spec.num_speculative_tokens}"
    tp = vllm_config.parallel_config.tensor_parallel_size
    return {"speculative": speculative, "tensor_parallel_size": str(tp)}


def worker_contract(
    model: torch.nn.Module, sampler: Any, vllm_config: Any, rejection_sampler: Any = None
) -> Contract:
    """The contract of the model and sampler this worker runs, at its parallel degrees, and of
    its rejection sampler when it speculates (`speculation_of`)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if is_installed() and not has_admission(vllm_config):
        raise EngineSettingsError(
            "this IsoExec engine runs without IsoExec's admission check: pass "
            f"logits_processors=[{ADMISSION!r}] (as `isoexec engine serve` does), or requests "
            "with settings the trainer does not reproduce would be sampled under a MATCH"
        )
    hf = effective_config(vllm_config)
    sites = read_sites(model, sampler, hf)
    if vllm_config.lora_config is not None:
        sites.update(lora_sites(model, _lora_impl(vllm_config)))
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    # The TP degree this worker runs at: a site that does not claim TP invariance (a
    # row-parallel site reduced by vLLM's all-reduce) records it, so it never MATCHes a peer
    # at another degree.
    tp = get_tensor_model_parallel_world_size()
    par = vllm_config.parallel_config  # PP/DP/EP > 1 are refused at construction
    ep = tp * par.data_parallel_size if par.enable_expert_parallel else 1
    return contract_for(
        hf, dtype, sites, tp_size=tp, pp_size=par.pipeline_parallel_size, ep_size=ep,
        dp_size=par.data_parallel_size, **speculation_of(vllm_config, sampler, rejection_sampler),
    )  # fmt: skip


__all__ = [
    "EngineSettingsError",
    "checkpoint_config",
    "effective_config",
    "speculation_of",
    "worker_contract",
    "worker_settings",
]
