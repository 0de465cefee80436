"""The weight gate on every path that writes an engine worker's parameters.

Every way vLLM 0.32 writes a model's weights after it is built ends in the model's
`load_weights`: the initial checkpoint load, `collective_rpc("reload_weights")`
(`model_loader.reload.inplace`), the IPC, NCCL and M2N weight-transfer engines behind
`update_weights`, an RL framework's own worker extension, and IsoExec's `isoexec_load_weights`.
The transfer backends that write elsewhere are refused at start-up (`GATED_TRANSFER_BACKENDS`,
checked by `admission.refused_engine_settings`).
With `ISOEXEC=1` IsoExec serves each supported architecture with a subclass of vLLM's model
class (`ModelRegistry.register_model`, vLLM's extension point) whose `load_weights` lets the
first call (the checkpoint the engine starts from) through and then requires this worker's
MATCH, asking the handshake service on every call (a later verdict or a restarted run revokes
it). After a gated load it records the fingerprint of the weights the worker now holds (HF
names, as the trainer exports them).

The gate state is per process: a vLLM worker process holds one worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from isoexec.ops.gemm import clear_packed_weight_cache

log = logging.getLogger(__name__)
ENGINE_SIDE = "engine"


class WeightSyncRefusedError(RuntimeError):
    """Weights were offered to a worker that is not cleared, or arrived damaged."""


@dataclass(frozen=True)
class Clearance:
    """Where this worker got its MATCH: the service to ask before every weight write."""

    address: str
    token: str
    run_id: str
    rank: int
    tls: Any = None  # ClientTLS | None


@dataclass
class GateState:
    clearance: Clearance | None = None
    gated_loads: int = 0
    last_fingerprint: str | None = None  # of the weights held after the last gated load
    last_verdict: str | None = None  # of this worker's last offer (startup or on request)


STATE = GateState()
# Called once a gated model's first load (the checkpoint it starts from) is in, with the model
# and its vLLM config: what else starts then registers here (the served handshake's offer,
# `served_handshake.offer_when_loaded`), so the gate itself starts nothing.
FIRST_LOAD_HOOKS: list[Callable[[Any, Any], Any]] = []


def on_first_load(hook: Callable[[Any, Any], Any]) -> None:
    """Run `hook(model, vllm_config)` after every gated model's first load (once per hook)."""
    if hook not in FIRST_LOAD_HOOKS:
        FIRST_LOAD_HOOKS.append(hook)


def grant(clearance: Clearance) -> None:
    """This worker got MATCH (`isoexec_handshake`)."""
    STATE.clearance = clearance


def revoke() -> None:
    """A new offer is under way or did not MATCH: no weights until it does."""
    STATE.clearance = None


def require_match(path: str) -> None:
    """Raise `WeightSyncRefusedError` unless this worker has a MATCH the service still holds."""
    from isoexec.handshake.client import HandshakeClient
    from isoexec.handshake.types import HandshakeError

    c = STATE.clearance
    if c is None:
        raise WeightSyncRefusedError(
            f"weight write through {path} refused: this engine worker has no MATCH from the "
            "handshake (offer the contract first; a restarted worker must offer again)"
        )
    try:
        with HandshakeClient(c.address, c.token, timeout_s=30.0, tls=c.tls) as client:
            ok, reason = client.may_receive_weights(c.run_id, ENGINE_SIDE, c.rank)
    except HandshakeError as e:
        raise WeightSyncRefusedError(
            f"weight write through {path} refused: the handshake service that gave this worker "
            f"its MATCH cannot confirm it ({e}); offer the contract again"
        ) from None
    if not ok:
        raise WeightSyncRefusedError(
            f"weight write through {path} refused by the handshake service: {reason}"
        )


class GatedLoadWeights:
    """Mixin before a vLLM model class: `load_weights` passes the gate after the first load."""

    _isoexec_loaded_once = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        gated = self._isoexec_loaded_once
        if gated:
            require_match(f"{type(self).__name__}.load_weights")
        out = super().load_weights(weights)  # type: ignore[misc]
        if not gated:  # the checkpoint is in: e.g. a served engine offers its contract now
            for hook in FIRST_LOAD_HOOKS:
                hook(self, _vllm_config(self))
        self._isoexec_loaded_once = True
        clear_packed_weight_cache()  # the loaders write through `.data`: no version bump
        if gated:
            STATE.gated_loads += 1
            STATE.last_fingerprint = _fingerprint(self)
            log.info("isoexec: weights loaded through the gate; fingerprint %s",
                     STATE.last_fingerprint)  # fmt: skip
        return out


def _vllm_config(model: Any) -> Any:
    """The config vLLM built `model` from (current while the worker loads its model)."""
    cfg = getattr(model, "vllm_config", None)
    if cfg is None:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
    return cfg


def _fingerprint(model: Any) -> str | None:
    """Fingerprint of the weights `model` holds, in HF names; None where the layout is not
    mapped back (a sharded engine, TP>1)."""
    from isoexec.contract.fingerprint import WeightFingerprint
    from isoexec.vllm.weights import UnsupportedWeightLayoutError, hf_named_weights

    # The HF config vLLM built the model from: the whole one where the model keeps it (a
    # vision-language checkpoint's names depend on it), else the model's own (flat) config.
    vllm_config = getattr(model, "vllm_config", None)
    source = vllm_config.model_config.hf_config if vllm_config is not None else model.config
    hf = source.to_dict()
    try:
        return WeightFingerprint.of(hf_named_weights(model, hf)).digest
    except UnsupportedWeightLayoutError:
        return None


GATED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM",
    # IsoExec's own class (its gated attention canonical), gated like the others
    "Qwen3NextForCausalLM": "isoexec.vllm.qwen3_next:IsoQwen3NextForCausalLM",
}


def gated(base: type) -> type:
    """`base` with the gated `load_weights` (same name, same interfaces)."""
    return type(base.__name__, (GatedLoadWeights, base), {"__module__": __name__})


# vLLM's weight-transfer backends that write through the model's `load_weights`, where the gate
# sees every write (IPC, NCCL, M2N: measured in vLLM 0.32's source). The others are refused at
# start-up (`admission.refused_engine_settings`): sparse_nccl applies checkpoint patches through
# the parameters' own loaders, sharded_rdt writes `param.data` on its fast path, modelexpress is
# an external package, and a backend vLLM adds later is unknown. Tests:
# integration/test_weight_gate_paths.py, tests/vllm/test_admission.py.
GATED_TRANSFER_BACKENDS = ("ipc", "nccl", "nccl_m2n")


def register_gated_models() -> None:
    """Serve the supported architectures with gated subclasses (before any model is built)."""
    import importlib

    from vllm import ModelRegistry

    for arch, target in GATED_ARCHITECTURES.items():
        module, name = target.split(":")
        ModelRegistry.register_model(arch, gated(getattr(importlib.import_module(module), name)))


__all__ = [
    "GATED_ARCHITECTURES",
    "GATED_TRANSFER_BACKENDS",
    "STATE",
    "Clearance",
    "GatedLoadWeights",
    "WeightSyncRefusedError",
    "grant",
    "register_gated_models",
    "require_match",
    "revoke",
]
