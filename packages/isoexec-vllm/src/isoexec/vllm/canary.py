"""The engine's numeric canary (`isoexec.contract.canary`): the run's probe as a prompt-logprobs
request, run in one batch with a few other requests (a canary scored alone would miss what
batching does), offered to the handshake service as engine/0.

Shared by the engine harness (`EngineProcess.call("canary", ...)`, through `LLM`) and the
served engine (`served_routes`, through the server's `AsyncLLM`): this module builds the
requests, reads the probe's logprobs back and offers them; each caller submits the requests
its own way.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from isoexec.contract.canary import canary_probe
from isoexec.handshake.client import HandshakeClient
from isoexec.handshake.tls import ClientTLS
from vllm import SamplingParams

ENGINE_SIDE = "engine"


def probe_for(vllm_config: Any, run_id: str) -> list[int]:
    return canary_probe(run_id, int(vllm_config.model_config.hf_text_config.vocab_size))


def canary_batch(probe: list[int]) -> list[tuple[list[int], SamplingParams]]:
    """The probe (prompt logprobs, one token generated) first, then three other requests of
    other lengths that decode while it prefills."""
    score = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    fill = SamplingParams(max_tokens=4, detokenize=False, ignore_eos=True)
    others = [probe[:17], probe[40:][::-1], probe[3:9] * 4]
    return [(probe, score)] + [(p, fill) for p in others]


def probe_logprobs(probe: list[int], prompt_logprobs: list[Any]) -> list[float]:
    """The logprob of each probe token 1..n-1 from vLLM's prompt logprobs (entry 0 is None)."""
    return [float(step[t].logprob) for t, step in zip(probe[1:], prompt_logprobs[1:], strict=True)]


def offer(
    values: list[float],
    *,
    address: str,
    token: str,
    run_id: str,
    weights_version: int,
    tls: ClientTLS | None,
    scored_s: float,
    timeout_s: float = 600.0,
    rank: int = 0,
) -> dict[str, Any]:
    """Offer the engine's canary as engine/`rank` (its first worker's engine rank); the
    verdict as a plain dict (it crosses processes)."""
    with HandshakeClient(address, token, timeout_s=timeout_s, tls=tls) as client:
        verdict = client.offer_canary(run_id, ENGINE_SIDE, rank, weights_version, values)
    out = asdict(verdict)
    out["matched"] = verdict.matched
    out["engine_scored_s"] = scored_s
    return out


__all__ = ["canary_batch", "offer", "probe_for", "probe_logprobs"]
