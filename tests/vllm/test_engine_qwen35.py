"""Qwen3.5 text (`Qwen3_5ForCausalLM`: GDN hybrid + gated attention, dense MLP, split GDN
projections) on real vLLM (CPU) with IsoExec.

Stock vLLM cannot import its Qwen3.5 model here (it pulls in Qwen3-VL, hence torchvision);
under ISOEXEC=1 the plugin registers IsoExec's text-only class. These tests check that it
generates in fp32 and bf16 with every contract site canonical, that its logprobs are bitwise
invariant across batching, chunked prefill (continuing from stored GDN state), prefix caching
and decode vs prefill, that its live weights hash like the checkpoint (split in_proj_* names),
and that with ISOEXEC off nothing is registered. bf16 runs every situation; fp32 skips chunked
prefill (one engine start less).
"""

from __future__ import annotations

import operator
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _invariance import assert_finite, differences, non_canonical_sites, observations
from safetensors.torch import load_file

from isoexec.contract.contract import Contract
from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.vllm.gdn import worker_output_gates

pytestmark = pytest.mark.engine

PRESET = "tiny-qwen35"  # layers: GDN, attention, GDN, attention
VOCAB = 512
_MODEL_CLASS = operator.attrgetter("model_runner.model.__class__.__qualname__")


@pytest.mark.parametrize(("dtype", "chunked"), [("bfloat16", True), ("float32", False)])
def test_qwen35_engine_is_canonical_and_bitwise_invariant(
    engine_pool: Callable[..., Any],
    model_factory: Callable[[str, str], str],
    dtype: str,
    chunked: bool,
) -> None:
    model = model_factory(PRESET, dtype)
    obs = observations(engine_pool, model, dtype, VOCAB, chunked_prefill=chunked)
    assert_finite(obs)
    assert len(obs["decode"]) == len(obs["alone"]) + 6  # it generated
    eng = engine_pool(model=model, dtype=dtype, isoexec=True)
    assert eng.call("collective_rpc", _MODEL_CLASS) == ["IsoQwen3_5ForCausalLM"]
    contract = Contract.from_bytes(eng.call("contract"))
    assert contract.model.architecture == "Qwen3_5ForCausalLM"
    assert contract.native_sites == ()
    assert non_canonical_sites(eng) == []
    sites = dict(eng.call("sites"))
    assert sites["layers.0.linear_attn.in_proj_qkvz"][1] == "isoexec.linear.rowblock"
    assert sites["layers.2.linear_attn.recurrence"][1] == "isoexec.gdn_recurrence.token_serial"
    assert sites["layers.1.self_attn.rope"][1] == "isoexec.rope.neox_fp32"
    assert sites["layers.3.mlp.act"][1] == "isoexec.silu_mul.fp32"
    (gates,) = eng.call("collective_rpc", worker_output_gates)
    assert gates == dict.fromkeys(
        ("layers.1.self_attn", "layers.3.self_attn"), "isoexec.attn_output_gate.sigmoid_mul"
    )
    diffs = differences(obs)
    print(f"{PRESET} {dtype} mismatches per situation:", diffs)
    assert diffs == dict.fromkeys(diffs, 0)


def test_qwen35_engine_fingerprint_equals_checkpoint(
    model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    """The fused in_proj_qkvz / in_proj_ba are exported as the checkpoint's split tensors."""
    model = model_factory(PRESET, "float32")
    ckpt = load_file(str(Path(model) / "model.safetensors"))
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in ckpt
    eng = engine_pool(model=model, isoexec=True)  # the fp32 engine of the test above
    (params,) = eng.call("collective_rpc", "isoexec_param_shapes")
    shapes = {name: shape for name, shape, _ in params}
    assert shapes["model.layers.0.linear_attn.in_proj_qkvz.weight"] == [384, 128]  # [qkv; z]
    assert eng.call("weight_fingerprint") == [WeightFingerprint.of(ckpt).digest]


_REGISTRY_PROBE = """
import importlib.util
from vllm import ModelRegistry
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.plugins import load_general_plugins
load_general_plugins()
from isoexec.vllm.install import is_installed
from isoexec.vllm.qwen3_5 import ARCHITECTURES
print("torchvision", importlib.util.find_spec("torchvision") is not None)
print("installed", is_installed(), "oot", sorted(op_registry_oot))
for arch in ARCHITECTURES:
    entry = ModelRegistry.models[arch]
    cls = entry.model_cls if hasattr(entry, "model_cls") else None
    hook = MODELS_CONFIG_MAP[arch].__name__
    print(arch, type(entry).__name__, getattr(cls, "__module__", ""), hook)
"""


def test_isoexec_off_serves_qwen35_text_only_with_stock_layers() -> None:
    """ISOEXEC unset, no torchvision (stock vLLM cannot import its Qwen3.5 classes here): the
    plugin registers the text-only classes ungated, with stock layers (no canonical op is
    registered), so a stock arm serves these checkpoints; the vision-language names get the
    causal-LM config hook (1-D positions)."""
    env = {k: v for k, v in os.environ.items() if k != "ISOEXEC"}
    out = subprocess.run(
        [sys.executable, "-c", _REGISTRY_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = out.stdout.strip().splitlines()[-6:]
    assert lines[0] == "torchvision False", "this test is about an engine without torchvision"
    assert lines[1] == "installed False oot []", out.stdout
    assert lines[2:] == [
        "Qwen3_5ForCausalLM _RegisteredModel isoexec.vllm.qwen3_5 Qwen3_5ForCausalLMConfig",
        "Qwen3_5MoeForCausalLM _RegisteredModel isoexec.vllm.qwen3_5 Qwen3_5ForCausalLMConfig",
        "Qwen3_5ForConditionalGeneration _RegisteredModel isoexec.vllm.qwen3_5 "
        "Qwen3_5ForCausalLMConfig",
        "Qwen3_5MoeForConditionalGeneration _RegisteredModel isoexec.vllm.qwen3_5 "
        "Qwen3_5ForCausalLMConfig",
    ], out.stdout
