"""Fail closed on settings: IsoExec's admission check, through vLLM's logits-processor extension
point (`logits_processors=[ADMISSION]`, which the launcher and the engine harness pass).

A MATCH promises bitwise logprobs for what the contract describes. A request setting or an
engine setting that changes the sampled distribution without the contract knowing (a
grammar, bad words, a config override) would give a MATCH whose bits differ — the
one outcome the contract exists to prevent. So settings are checked against an allow-list,
not a deny-list: a field vLLM adds tomorrow is refused until someone puts it on the list.

- **Per request** (`validate_params`): vLLM calls it at admission, in the frontend, before
  the request joins a batch. A refusal is that request's error alone — HTTP 400 on the OpenAI
  server, a `ValueError` from `LLM`/`AsyncLLM` — never an engine crash.
- **Per engine** (the constructor): vLLM builds the processor in each worker before the model
  serves, so an engine configured with a refused setting does not start.

The processor never changes logits (`apply` returns them as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from isoexec.vllm.engine_kwargs import ADMISSION
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

# The speculative methods an IsoExec engine runs: drafts from the request's own tokens, verified
# on canonical rows (`isoexec.vllm.spec_decode`).
SPECULATIVE_METHODS = ("ngram",)

_ADJUSTMENT = "canonical adjustment (isoexec.ops.penalties); the trainer scores with the same"

# SamplingParams fields a request may set to any value, and why that leaves the bits alone or
# is what the trainer is told. Every other field must be at its default (or a neutral value).
ALLOWED_REQUEST_FIELDS: Mapping[str, str] = {
    "n": "more samples of the same distribution",
    "temperature": "part of the canonical logprobs op; the trainer scores at the same temperature",
    "top_k": "canonical truncation (isoexec.ops.truncation); the trainer scores with the same",
    "top_p": "canonical truncation (isoexec.ops.truncation); the trainer scores with the same",
    "min_p": "canonical truncation (isoexec.ops.truncation); the trainer scores with the same",
    "presence_penalty": _ADJUSTMENT,
    "frequency_penalty": _ADJUSTMENT,
    "repetition_penalty": _ADJUSTMENT,
    "logit_bias": _ADJUSTMENT,
    "allowed_token_ids": _ADJUSTMENT,
    "seed": "picks which token is drawn, not its logprob",
    "max_tokens": "where generation stops",
    "stop": "where generation stops",
    "stop_token_ids": "where generation stops",
    "ignore_eos": "where generation stops",
    "include_stop_str_in_output": "output text only",
    "logprobs": "how many logprobs are returned",
    "prompt_logprobs": "how many prompt logprobs are returned",
    "prompt_logprob_start": "from which prompt position logprobs are returned",
    "logprob_token_ids": "which entries of the canonical row are returned",
    "flat_logprobs": "the output's layout",
    "detokenize": "output text only",
    "skip_special_tokens": "output text only",
    "spaces_between_special_tokens": "output text only",
    "output_kind": "streaming or final output",
    "stream_interval": "streaming cadence",
    "skip_clone": "vLLM-internal copy avoidance",
    "skip_reading_prefix_cache": "canonical attention gives cached and recomputed KV the same bits",
    "routed_experts_prompt_start": "which routed-expert ids are returned (output only)",
    # Set by vLLM itself (from the stop strings and the tokenizer), never by the user.
    "output_text_buffer_length": "vLLM-internal, derived from the stop strings",
    "_eos_token_id": "vLLM-internal",
    "_all_stop_token_ids": "vLLM-internal",
    "_watermarking_skipped": "vLLM-internal",
}

# Values that mean "off" for fields whose default is another spelling of off.
_NEUTRAL: Mapping[str, tuple[Any, ...]] = {
    "watermarking": (None, False),
}

# Why a refused field changes the bits, for the message (fields not named here: "not on the
# allow-list").
_REFUSAL_REASONS: Mapping[str, str] = {
    "min_tokens": "masks the stop tokens for the first tokens",
    "bad_words": "masks tokens",
    "structured_outputs": "masks tokens by a grammar",
    "thinking_token_budget": "forces tokens",
    "watermarking": "changes the sampled distribution",
    "extra_args": "arguments for custom logits processors",
}


class SettingRefusedError(ValueError):
    """A request or engine setting IsoExec does not reproduce on the trainer."""


def _is_off(field: str, value: Any, default: Any) -> bool:
    if value == default or value in _NEUTRAL.get(field, ()):
        return True
    return default is None and isinstance(value, (list, dict, set, tuple)) and not value


def refused_request_fields(params: SamplingParams) -> dict[str, Any]:
    """The fields of `params` set to a value IsoExec does not allow (field -> value)."""
    default = type(params)()  # its own class's defaults (a subclass may add fields)
    out = {}
    for field in params.__struct_fields__:
        if field in ALLOWED_REQUEST_FIELDS:
            continue
        value = getattr(params, field)
        if not _is_off(field, value, getattr(default, field)):
            out[field] = value
    return out


def check_request(params: SamplingParams) -> None:
    """Raise `SettingRefusedError` naming every refused field of this request."""
    refused = refused_request_fields(params)
    if not refused:
        return
    reasons = {k: _REFUSAL_REASONS.get(k, "not on the allow-list") for k in refused}
    parts = [f"{k}={v!r} ({reasons[k]})" for k, v in refused.items()]
    raise SettingRefusedError(
        "IsoExec refuses this request: " + "; ".join(parts) + ". The trainer would score a "
        "distribution other than the one sampled (allowed settings: docs/reliability.md)."
    )


def refused_engine_settings(vllm_config: Any) -> list[str]:
    """The engine settings that change the bits without the contract recording them."""
    from isoexec.ops.call_verify import VERIFY_CALLS_ENV, verify_calls_enabled
    from isoexec.vllm.graph_safety import refused_graph_settings
    from isoexec.vllm.lora import refused_lora_settings
    from isoexec.vllm.weight_gate import GATED_TRANSFER_BACKENDS

    model = vllm_config.model_config
    out = refused_lora_settings(vllm_config) + refused_graph_settings(vllm_config)
    spec = vllm_config.speculative_config
    if spec is not None and _is_hybrid(model):
        out.append(
            "speculative decoding on a GatedDeltaNet model: IsoExec's GDN layer keeps one "
            "recurrent state per request, not one per draft position (not canonical yet)"
        )
    elif spec is not None and spec.method not in SPECULATIVE_METHODS:
        out.append(
            f"speculative decoding by {spec.method!r}: IsoExec verifies drafts on canonical "
            f"rows for {', '.join(SPECULATIVE_METHODS)} only (its draft models are not IsoExec "
            "models, and untested)"
        )
    elif spec is not None and (
        vllm_config.lora_config is not None
        or vllm_config.parallel_config.tensor_parallel_size > 1
        or model.logprobs_mode != "processed_logprobs"
    ):
        out.append(
            "speculative decoding with LoRA, engine TP>1 or raw_logprobs: allowed only where "
            "it is tested bitwise (one engine rank, no adapters, processed logprobs)"
        )
    if model.quantization is not None:
        out.append(f"quantization={model.quantization!r}: the canonical ops run unquantized")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        out.append(f"kv_cache_dtype={cache_dtype!r}: the KV cache is kept in the model dtype")
    others = [p for p in (model.logits_processors or []) if _name(p) != ADMISSION]
    if others:
        out.append(f"logits_processors={[_name(p) for p in others]}: they change the logits")
    if getattr(vllm_config, "watermark_config", None) is not None:
        out.append("watermarking: it changes the sampled distribution")
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    if transfer is not None and transfer.backend not in GATED_TRANSFER_BACKENDS:
        out.append(
            f"weight_transfer_config backend {transfer.backend!r}: it writes parameters outside "
            "the model's load_weights, where the weight gate cannot require a MATCH (use "
            f"{', '.join(GATED_TRANSFER_BACKENDS)}, or isoexec_load_weights)"
        )
    if verify_calls_enabled() and not model.enforce_eager:
        out.append(
            f"{VERIFY_CALLS_ENV}=1 in a compiled engine: compiled graphs run the site calls "
            "without Python, where they cannot be checked (add enforce_eager)"
        )
    if callable(model.hf_overrides):
        out.append("hf_overrides as a function: the contract cannot record what it changed")
    return out


def _is_hybrid(model_config: Any) -> bool:
    """Whether the engine's model has GatedDeltaNet layers (by its architecture)."""
    from isoexec.contract.architectures import ARCHITECTURES

    names = getattr(model_config.hf_config, "architectures", None) or []
    return any(getattr(ARCHITECTURES.get(n), "hybrid", False) for n in names)


def _name(proc: Any) -> str:
    """`module:Class` (vLLM's spelling of a processor's name) for a name or a class."""
    return proc if isinstance(proc, str) else f"{proc.__module__}:{proc.__qualname__}"


def has_admission(vllm_config: Any) -> bool:
    """Whether this engine runs IsoExec's admission check."""
    return any(_name(p) == ADMISSION for p in (vllm_config.model_config.logits_processors or []))


class IsoAdmission(LogitsProcessor):
    """IsoExec's allow-list at admission (see the module docstring). Changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        check_request(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        refused = refused_engine_settings(vllm_config)
        if refused:
            raise SettingRefusedError(
                "IsoExec refuses to start this engine: "
                + "; ".join(refused)
                + " (allowed settings: docs/reliability.md)"
            )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True  # applied (as the identity) only to sampled rows

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None


# The test that shows each kind of decision (docs/reliability.md's allow-list tables).
ALLOWED_TEST = "tests/vllm/test_admission.py::test_allowed_settings_and_neutral_values_pass"
REFUSED_TEST = (
    "integration/test_served_admission.py::"
    "test_refused_settings_get_400_alone_and_good_requests_stay_bitwise"
)
UNLISTED_TEST = "tests/vllm/test_admission.py::test_a_field_vllm_adds_fails_closed"
# The truncation fields are allowed because the engine and the trainer share the op; their
# bitwise test is the served one (the sampler's own: tests/vllm/test_sampler_truncation.py).
TRUNCATION_TEST = (
    "integration/test_served_admission.py::"
    "test_refused_settings_get_400_alone_and_good_requests_stay_bitwise"
)
# The adjustments: the served test covers each of them; the engine matrix is
# integration/test_trainer_engine.py, the sampler's own tests/vllm/test_sampler_penalties.py.
_ADJUSTMENTS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                "allowed_token_ids")  # fmt: skip
_TESTS_OF_ALLOWED = {
    **{field: TRUNCATION_TEST for field in ("top_k", "top_p", "min_p")},
    **{field: TRUNCATION_TEST for field in _ADJUSTMENTS},
}


def allow_list_markdown() -> str:
    """The request allow-list as docs/reliability.md shows it (a test keeps the two equal)."""
    rows = ["| request setting | decision | why | test |", "|---|---|---|---|"]
    for field, why in ALLOWED_REQUEST_FIELDS.items():
        test = _TESTS_OF_ALLOWED.get(field, ALLOWED_TEST)
        rows.append(f"| `{field}` | allowed | {why} | `{test}` |")
    for field, why in _REFUSAL_REASONS.items():
        rows.append(f"| `{field}` | refused unless neutral | {why} | `{REFUSED_TEST}` |")
    rows.append(f"| any other field | refused unless at its default | not on the allow-list | "
                f"`{UNLISTED_TEST}` |")  # fmt: skip
    return "\n".join(rows) + "\n"


__all__ = [
    "ADMISSION",
    "ALLOWED_REQUEST_FIELDS",
    "IsoAdmission",
    "SettingRefusedError",
    "allow_list_markdown",
    "check_request",
    "has_admission",
    "refused_engine_settings",
    "refused_request_fields",
]
