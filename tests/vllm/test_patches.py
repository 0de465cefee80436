"""`isoexec.vllm.patches`: the writes into vLLM without an extension point refuse loudly when
vLLM's internals are not the ones they were written for (never a silent no-op)."""

from __future__ import annotations

import json
import os
import types

import pytest

from isoexec.contract.patch_table import DECLARED
from isoexec.contract.patching import PatchRegistry
from isoexec.vllm import patches


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> PatchRegistry:
    """A fresh engine registry (this process's own stays as the engine left it)."""
    reg = PatchRegistry("engine", DECLARED)
    monkeypatch.setattr(patches, "REGISTRY", reg)
    return reg


def test_rebind_refuses_a_missing_name_and_writes_an_existing_one(registry: PatchRegistry) -> None:
    gone = types.ModuleType("vllm_future")
    with pytest.raises(patches.VllmVersionError, match=r"vllm_future.Sampler is gone"):
        patches._rebind("sampler", gone, "Sampler", int)
    present = types.ModuleType("vllm_now")
    present.Sampler = object  # type: ignore[attr-defined]
    patches._rebind("sampler", present, "Sampler", int)
    assert present.Sampler is int  # type: ignore[attr-defined]
    assert registry.applied() == ["sampler"]
    registry.undo("sampler")
    assert present.Sampler is object  # type: ignore[attr-defined]


def test_text_only_config_hook(monkeypatch: pytest.MonkeyPatch, registry: PatchRegistry) -> None:
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


INSTALL_AND_UNDO = """
import json
import vllm.v1.worker.gpu_model_runner as runner
from vllm.lora.worker_manager import WorkerLoRAManager
from vllm.v1.engine.input_processor import InputProcessor as P
from isoexec.vllm.install import install_plugin
from isoexec.vllm.patches import REGISTRY
before = (runner.Sampler, WorkerLoRAManager._load_adapter, P._validate_lora)
install_plugin()
applied = REGISTRY.applied()
after = (runner.Sampler, WorkerLoRAManager._load_adapter, P._validate_lora)
REGISTRY.undo_all()
undone = (runner.Sampler, WorkerLoRAManager._load_adapter, P._validate_lora)
print(json.dumps(applied))
print(after[0] is not before[0], after[1] is not before[1], after[2] is not before[2])
print(undone[0] is before[0], undone[1] is before[1], undone[2] is before[2])
"""


def test_install_applies_declared_patches_and_undo_restores_vllm() -> None:
    """In a fresh process: installing IsoExec applies its engine patches through the registry
    (each one declared), and undoing them gives vLLM back its own objects."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", INSTALL_AND_UNDO], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "ISOEXEC": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    applied, changed, restored = out.stdout.strip().splitlines()[-3:]
    names = set(json.loads(applied))
    declared = {e.name for e in DECLARED if e.side == "engine"}
    assert names <= declared and {"sampler", "adapter_loads", "lora_admission"} <= names
    assert changed == "True True True"  # the install wrote into vLLM (else the test proves nothing)
    assert restored == "True True True"
