"""A LoRA adapter's identity, the same on both sides: what its PEFT config says that changes the
bits (`AdapterConfig`) and one fingerprint over that config and its tensors
(`adapter_fingerprint`).

The fingerprint covers the config, not only the tensors: vLLM folds the scaling (alpha / r, or
alpha / sqrt(r) with rsLoRA) into B when it loads an adapter, so the same tensors under another
alpha give other bits. The trainer fingerprints the adapter it holds
(`isoexec.megatron.lora.TrainerLora.fingerprint`), the engine's adapter gate the one it is
about to load (`isoexec.vllm.adapter_gate`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoexec.contract.fingerprint import WeightFingerprint

# Where PEFT names a decoder layer's adapter tensors: `{PEFT_PREFIX}.{i}.{parent}.{module}...`
PEFT_PREFIX = "base_model.model.model.layers"
# The PEFT target modules IsoExec applies canonically on both sides.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraAdapterError(ValueError):
    """An adapter IsoExec cannot apply canonically, or a malformed adapter directory."""


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter's `adapter_config.json` says that changes the bits."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's (and vLLM's) scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def identity(self) -> dict[str, Any]:
        """The fields the fingerprint covers (floats exact, as hex)."""
        return {"r": self.rank, "lora_alpha": float(self.alpha).hex(),
                "use_rslora": self.use_rslora, "target_modules": list(self.targets)}  # fmt: skip

    @staticmethod
    def from_mapping(cfg: Mapping[str, Any], where: str = "adapter_config.json") -> AdapterConfig:
        """Parse PEFT's config, refusing what the canonical op does not compute."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise LoraAdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
        targets = cfg.get("target_modules")
        if isinstance(targets, str) or not targets:
            raise LoraAdapterError(f"{where}: target_modules must be a list of module names")
        for key, neutral in (("bias", "none"), ("fan_in_fan_out", False)):
            if cfg.get(key, neutral) != neutral:
                raise LoraAdapterError(f"{where}: {key}={cfg[key]!r} is not supported")
        for key in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
            if cfg.get(key):
                raise LoraAdapterError(f"{where}: {key} is not supported")
        if cfg.get("use_dora"):
            raise LoraAdapterError(f"{where}: DoRA is not supported")
        unknown = sorted(set(targets) - set(SUPPORTED_TARGETS))
        if unknown:
            raise LoraAdapterError(
                f"{where}: target modules {unknown} have no canonical LoRA site "
                f"(supported: {list(SUPPORTED_TARGETS)})"
            )
        return AdapterConfig(
            rank=int(cfg["r"]),
            alpha=float(cfg["lora_alpha"]),
            targets=tuple(sorted(targets)),
            use_rslora=bool(cfg.get("use_rslora", False)),
        )

    @staticmethod
    def read(adapter_dir: str | Path) -> AdapterConfig:
        path = Path(adapter_dir) / "adapter_config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LoraAdapterError(f"{path}: not a readable adapter config: {e}") from None
        if not isinstance(cfg, dict):
            raise LoraAdapterError(f"{path}: not a JSON object")
        return AdapterConfig.from_mapping(cfg, str(path))


def adapter_fingerprint(tensors: Mapping[str, Any], config: AdapterConfig) -> str:
    """SHA-256 (hex) over the config's identity and the tensors' `WeightFingerprint`."""
    h = hashlib.sha256(json.dumps(config.identity(), sort_keys=True).encode())
    h.update(bytes.fromhex(WeightFingerprint.of(tensors).digest))
    return h.hexdigest()


_SERVED_DOMAIN = b"isoexec.weights+adapter/1\n"


def served_weights_fingerprint(weights: str, adapter: str | None) -> str:
    """The fingerprint of the weights a request runs under: the base weights' fingerprint,
    combined with the adapter's when one applies (the base alone otherwise). Engine and trainer
    compute it the same way, so an adapter that differs in one tensor or in alpha makes the
    weight fingerprints differ, not only the adapter gate's check."""
    if adapter is None:
        return weights
    for what, digest in (("weights", weights), ("adapter", adapter)):
        if not (isinstance(digest, str) and len(digest) == 64):
            raise ValueError(f"{what} fingerprint {digest!r} is not a SHA-256 hex digest")
    h = hashlib.sha256(_SERVED_DOMAIN)
    h.update(bytes.fromhex(weights))
    h.update(bytes.fromhex(adapter))
    return h.hexdigest()


__all__ = [
    "PEFT_PREFIX",
    "SUPPORTED_TARGETS",
    "AdapterConfig",
    "LoraAdapterError",
    "adapter_fingerprint",
    "served_weights_fingerprint",
]
