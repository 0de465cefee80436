"""IsoExec's options: the one object that selects *which* canonical implementation runs.

`ISOEXEC=1` switches IsoExec on; these options choose among canonical variants, and both
sides take the same object (the trainer as `build_model(..., options=)`, the engine through
vLLM's `additional_config["isoexec"]`). Whatever they choose ends up in the contract, so two
sides with different options are refused at the handshake, never silently mixed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

# The key under vLLM's `additional_config` (its extension point for plugin settings).
VLLM_ADDITIONAL_CONFIG_KEY = "isoexec"
# vLLM's logprobs modes that are logprobs (its *_logits modes are not): "processed_logprobs",
# the distribution sampled from (logits / T), and "raw_logprobs", the model's (T=1).
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
# Whose kernels the sites run: "torch" (the reference, any device) or "triton" (`isoexec.ops`
# registers one implementation per op for each).
BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class IsoExecOptions:
    """`tp_invariant`: row-parallel sites (o_proj, down_proj, out_proj) run the K-leaves
    `linear_tp`, so logprobs are bitwise the same at every TP degree dividing its leaves
    (a trainer at TP=2 can serve an engine at TP=1); off, they run the plain `linear`.

    `backend`: whose kernels every site runs — "torch" (the CPU/any-device reference) or
    "triton" (GPU kernels; on CPU only under TRITON_INTERPRET=1). Different bits, so a
    different contract: both sides must choose the same.

    `logprobs_mode`: which logprobs the engine returns and the trainer scores, in vLLM's
    names — "processed_logprobs" (logits / temperature: the distribution actually sampled, what
    a PPO ratio needs) or "raw_logprobs" (T=1 whatever the sampling temperature). The logprobs
    site records it on both sides, so a trainer scoring one against an engine returning the
    other is refused at the handshake.
    """

    tp_invariant: bool = False
    backend: str = "torch"
    logprobs_mode: str = "processed_logprobs"

    def __post_init__(self) -> None:
        if not isinstance(self.tp_invariant, bool):
            raise TypeError(
                f"IsoExec option 'tp_invariant' must be a bool, got {self.tp_invariant!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"IsoExec option 'backend' {self.backend!r}; known: {list(BACKENDS)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"IsoExec option 'logprobs_mode' {self.logprobs_mode!r}; known: "
                f"{list(LOGPROBS_MODES)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> IsoExecOptions:
        """Parse; unknown keys and non-bool values are refused, never ignored."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise TypeError(f"IsoExec options must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown IsoExec option(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)


__all__ = ["BACKENDS", "LOGPROBS_MODES", "VLLM_ADDITIONAL_CONFIG_KEY", "IsoExecOptions"]
