"""The sampling record of a served completion: what the server attaches to every completion
response (`SAMPLING_HEADER`), built from the request and the model's sampling defaults.

Why here and not in vLLM: the OpenAI server applies a checkpoint's generation_config.json
defaults (temperature, top_k, top_p, a repetition penalty) to every request that names none,
and the client never sees them. The record states the effective values, by vLLM's own rule
(the request's value, else the model's default, else vLLM's neutral value), so the trainer
scores the distribution that was actually sampled (`isoexec.megatron.score_sampled`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from isoexec.contract.protocol import SAMPLING_EPS
from isoexec.handshake.served import MAX_SAMPLING_HEADER_BYTES, SAMPLING_HEADER, SamplingRecord

# The request fields the record carries that a generation config may default, and vLLM's
# value for each when neither the request nor the model's generation config sets it.
RECORDED_DEFAULTS = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}
LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps every bias to [-100, 100] (`SamplingParams.from_optional`)


def serving_models(request: Any) -> Any:
    """The server's `OpenAIServingModels` (its adapters)."""
    return request.app.state.openai_serving_models


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """vLLM's reading of an OpenAI logit_bias map: integer keys, each bias clamped."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias {value!r} is not a map")
    pairs = {int(k): min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
             for k, b in value.items()}  # fmt: skip
    return tuple(sorted(pairs.items()))


def _allowed(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise TypeError(f"allowed_token_ids {value!r} is not a list of ids")
    return tuple(sorted(set(value)))


def request_record(
    request: Any, body: dict[str, Any], version: int, fingerprint: str | None
) -> SamplingRecord:
    """The record of a completion request `body` admitted under weights `version`
    (`fingerprint`). Raises ValueError or TypeError on a malformed value."""
    model_config = request.app.state.vllm_config.model_config
    defaults = model_config.get_diff_sampling_param()
    effective = {}
    for field, neutral in RECORDED_DEFAULTS.items():
        value = body.get(field)
        effective[field] = defaults.get(field, neutral) if value is None else value
    name = body.get("model")
    served = serving_models(request).lora_requests
    adapter = name if isinstance(name, str) and name in served else None
    if float(effective["temperature"]) < SAMPLING_EPS:  # greedy: vLLM drops truncation
        effective.update(top_k=0, top_p=1.0, min_p=0.0)
    return SamplingRecord(
        float(effective["temperature"]),
        str(model_config.logprobs_mode),
        version,
        adapter,
        int(effective["top_k"]),
        float(effective["top_p"]),
        float(effective["min_p"]),
        fingerprint,
        float(effective["repetition_penalty"]),
        float(effective["frequency_penalty"]),
        float(effective["presence_penalty"]),
        _logit_bias(body.get("logit_bias")),
        _allowed(body.get("allowed_token_ids")),
    )


async def with_sampling_record(
    request: Any, call_next: Callable[[Any], Awaitable[Any]], version: int, fingerprint: str | None
) -> Any:
    """The response, with the request's `SamplingRecord` in `SAMPLING_HEADER`. A record too
    large to send (a very long allow-list or bias map) refuses the request with HTTP 400."""
    from fastapi.responses import JSONResponse

    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return await call_next(request)  # vLLM answers a malformed body itself
    if not isinstance(body, dict):
        body = {}
    try:
        header = request_record(request, body, version, fingerprint).to_header()
    except (TypeError, ValueError):
        return await call_next(request)  # a malformed value: vLLM's own validation answers
    if len(header) > MAX_SAMPLING_HEADER_BYTES:
        message = (
            f"IsoExec refuses this request: its sampling record would be {len(header)} bytes "
            f"(at most {MAX_SAMPLING_HEADER_BYTES}; a long allowed_token_ids or logit_bias), "
            "more than an HTTP client reads in a header; the trainer could not score it"
        )
        return JSONResponse({"error": {"message": message, "type": "BadRequestError",
                                       "code": 400}}, status_code=400)  # fmt: skip
    response = await call_next(request)
    response.headers[SAMPLING_HEADER] = header
    return response


__all__ = ["RECORDED_DEFAULTS", "request_record", "serving_models", "with_sampling_record"]
