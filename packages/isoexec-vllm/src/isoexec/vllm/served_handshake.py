"""A served worker offers its contract as soon as it has loaded its checkpoint.

Given `additional_config[HANDSHAKE_CONFIG_KEY]` (`isoexec.handshake.served.ServedHandshake`),
`offer_when_loaded` runs as a first-load hook of the weight gate (registered at install,
`weight_gate.on_first_load`; the gate itself starts nothing) once the gated model's first
`load_weights` (the checkpoint the engine starts from; again in a restarted worker) is in: the
settings and the token file are checked there
(a malformed setting stops the engine from starting, loudly), and a background thread reads the
worker's contract back and offers it, so the engine finishes starting while the service waits
for the trainer. The worker is cleared for weights only on MATCH (`weight_gate`); the verdict
is logged and kept for `isoexec_gate_status`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from isoexec.handshake.served import HANDSHAKE_CONFIG_KEY, ServedHandshake
from isoexec.vllm import weight_gate

# Under vLLM's logger, so the verdict shows in the server's own log with vLLM's format.
log = logging.getLogger("vllm.isoexec.served_handshake")
ENGINE_SIDE = "engine"


def served_handshake(vllm_config: Any) -> ServedHandshake | None:
    """The handshake settings the engine was started with, or None (offer on request only)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(HANDSHAKE_CONFIG_KEY)
    return None if raw is None else ServedHandshake.from_mapping(raw)


def offer_when_loaded(model: torch.nn.Module, vllm_config: Any) -> threading.Thread | None:
    """Start this worker's offer (if the engine was given a handshake); returns its thread."""
    from isoexec.vllm.engine_contract import worker_contract, worker_settings
    from isoexec.vllm.logprobs import built_sampler
    from vllm.distributed import get_tensor_model_parallel_rank

    settings = served_handshake(vllm_config)
    if settings is None:
        return None
    token = settings.token()  # refused now (engine start fails) if missing or empty
    rank = get_tensor_model_parallel_rank()
    sampler = built_sampler()
    weight_gate.revoke()
    if vllm_config.lora_config is None:
        contract = worker_contract(model, sampler, vllm_config)
        build = lambda: contract  # noqa: E731
    else:  # vLLM wraps the LoRA layers after this load: read the contract once it has
        build = lambda: _after_lora_wrapping(  # noqa: E731
            model, lambda: worker_contract(model, sampler, vllm_config)
        )
    offered = worker_settings(vllm_config)  # beside the contract, unhashed
    thread = threading.Thread(target=_offer, args=(settings, token, rank, build, offered),
                              name="isoexec-offer", daemon=True)  # fmt: skip
    thread.start()
    return thread


LORA_WRAP_TIMEOUT_S = 600.0


def _after_lora_wrapping(model: torch.nn.Module, build: Any) -> Any:
    """`build()` once vLLM's LoRA manager has wrapped the model's layers (it does so right
    after the checkpoint load that starts the offer): a contract read before would declare
    no LoRA sites."""
    import time

    from vllm.lora.layers import BaseLayerWithLoRA

    deadline = time.monotonic() + LORA_WRAP_TIMEOUT_S
    while not any(isinstance(m, BaseLayerWithLoRA) for m in model.modules()):
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM's LoRA manager did not wrap the model's layers")
        time.sleep(0.2)
    time.sleep(0.5)  # the manager replaces modules one by one: let it finish
    return build()


def _offer(
    settings: ServedHandshake, token: str, rank: int, build: Any, offered: dict[str, str]
) -> None:
    from isoexec.handshake.client import HandshakeClient

    tls = settings.client_tls()
    try:
        contract = build()
    except Exception as e:  # a refused site: no offer, no weights
        weight_gate.STATE.last_verdict = f"ERROR: {e}"
        log.error("isoexec: engine rank %d: no contract to offer: %s", rank, e)
        return
    log.info("isoexec: engine rank %d offers contract %s to %s (run %s; %s)", rank,
             contract.hash[:12], settings.address, settings.run_id,
             " ".join(f"{k}={v}" for k, v in sorted(offered.items())))  # fmt: skip
    try:
        with HandshakeClient(settings.address, token, timeout_s=settings.timeout_s,
                             tls=tls) as client:  # fmt: skip
            verdict = client.offer(settings.run_id, ENGINE_SIDE, rank, contract,
                                   settings=offered)  # fmt: skip
    except Exception as e:  # the worker keeps serving, uncleared: no weights can be pushed
        weight_gate.STATE.last_verdict = f"ERROR: {e}"
        log.error("isoexec: engine rank %d: the handshake failed: %s", rank, e)
        return
    weight_gate.STATE.last_verdict = verdict.outcome
    if verdict.matched:
        weight_gate.grant(
            weight_gate.Clearance(settings.address, token, settings.run_id, rank, tls)
        )
        log.info("isoexec: engine rank %d: MATCH %s", rank, verdict.contract_hash[:12])
    else:
        log.error("isoexec: engine rank %d: %s, no weights will be accepted:\n%s", rank,
                  verdict.outcome, "\n".join(verdict.diff))  # fmt: skip


__all__ = ["offer_when_loaded", "served_handshake"]
