"""`isoexec.vllm.patches`: the writes into vLLM without an extension point refuse loudly when
vLLM's internals are not the ones they were written for (never a silent no-op)."""

from __future__ import annotations

import types

import pytest

from isoexec.vllm import patches


def test_rebind_refuses_a_missing_name_and_writes_an_existing_one() -> None:
    gone = types.ModuleType("vllm_future")
    with pytest.raises(patches.VllmVersionError, match=r"vllm_future.Sampler is gone"):
        patches._rebind(gone, "Sampler", int)
    present = types.ModuleType("vllm_now")
    present.Sampler = object  # type: ignore[attr-defined]
    patches._rebind(present, "Sampler", int)
    assert present.Sampler is int  # type: ignore[attr-defined]


def test_text_only_config_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.models import config as model_configs

    table = dict(model_configs.MODELS_CONFIG_MAP)
    monkeypatch.setattr(model_configs, "MODELS_CONFIG_MAP", table)
    patches.text_only_config_hook("Qwen3_5MoeForConditionalGeneration")
    assert table["Qwen3_5MoeForConditionalGeneration"] is table["Qwen3_5MoeForCausalLM"]
    patches.text_only_config_hook("Qwen3ForCausalLM")  # not a vision-language name: no-op
    del table["Qwen3_5ForCausalLM"]
    with pytest.raises(patches.VllmVersionError, match="no config hook"):
        patches.text_only_config_hook("Qwen3_5ForConditionalGeneration")


def test_shared_protocol_facts_are_vllms_and_both_sides_refuse_alike() -> None:
    """The constants both sides import from `isoexec.contract.protocol` are vLLM's own values
    (a vLLM upgrade that changes them fails here), and each side's refusal error is the shared
    `SiteRefusedError`."""
    from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE
    from vllm.sampling_params import _SAMPLING_EPS

    from isoexec.contract.protocol import LM_HEAD_ROW_PADDING, SAMPLING_EPS, SiteRefusedError
    from isoexec.megatron.canonical_base import CanonicalSiteError
    from isoexec.vllm.layers import UnsupportedSiteError

    assert SAMPLING_EPS == _SAMPLING_EPS and LM_HEAD_ROW_PADDING == DEFAULT_VOCAB_PADDING_SIZE
    assert issubclass(CanonicalSiteError, SiteRefusedError)
    assert issubclass(UnsupportedSiteError, SiteRefusedError)
