"""`isoexec pair --lora`: the adapter's part of an IsoExec arm. The trainer attaches the
adapter; after MATCH the engine loads it through the adapter gate (announced with the trainer's
fingerprint of it) and both canaries run under it."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from isoexec.tools.pair_report import progress
from isoexec.tools.pair_steps import handshake

# vLLM's allowed `max_lora_rank` values: the engine pads adapters to one (the canonical op too).
VLLM_LORA_RANKS = (16, 32, 64, 128, 256, 320, 512)


class LoraArmError(ValueError):
    """An arm `--lora` cannot run (reported in the table, like a stock arm that cannot run)."""


def lora_rank_for(adapter_dir: str) -> int:
    """The engine's `max_lora_rank` for this adapter: the smallest vLLM allows that holds it."""
    r = int(json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["r"])
    for rank in VLLM_LORA_RANKS:
        if r <= rank:
            return rank
    raise LoraArmError(f"adapter rank {r} > vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def attach_adapter(model: Any, adapter_dir: str, rank: int) -> Any:
    """Attach the adapter to the trainer's model; the engine's name for it."""
    from isoexec.megatron.lora import attach_lora
    from isoexec.vllm.engine_process import LoraAdapter

    attach_lora(model, adapter_dir, rank=rank)
    return LoraAdapter("pair-lora", 1, str(Path(adapter_dir).resolve()))


def lora_handshake(contract: Any, engine: Any, model: Any, adapter: Any) -> tuple[Any, Any]:
    """MATCH, then the adapter through the engine's gate (announced with the trainer's
    fingerprint), then both canaries under it, while the service is up."""
    from isoexec.handshake.server import HandshakeServer
    from isoexec.tools.pair_steps import canaries

    token = secrets.token_hex(16)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        trainer_verdict, engine_verdict = handshake(contract, engine, server=server, token=token)
        if trainer_verdict.matched and engine_verdict["outcome"] == "MATCH":
            engine.call("add_lora", adapter, model.isoexec_lora.fingerprint())
            progress("isoexec", f"adapter {adapter.path} loaded through the gate")
            _, canary = canaries(model, engine, server.address, token, "pair", 0, lora=adapter)
            engine_verdict = {**engine_verdict, "canary": canary}
    return trainer_verdict, engine_verdict
