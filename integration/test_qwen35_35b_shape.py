"""Qwen3.5-35B-A3B's real text widths on both sides, on CPU: hidden 2048, head_dim 256, 16
query / 2 KV heads, GDN with 16 key / 32 value heads of 128, 256 experts top-8 of width 512 and
a shared expert of 512 — with one GDN and one attention layer and a 1024-token vocab so that a
checkpoint (3.2 GB in bf16, release layout) and both sides fit this machine.

The tiny presets cannot show that the canonical ops and both sides' layouts hold at the widths
that matter (tile sizes, head splits, 256-way routing). Trainer (Megatron, torchrun) and engine
(vLLM, IsoExec) MATCH and score a few sampled sequences bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _pairing import aligned_logprobs, scoring_jobs

from isoexec.contract.contract import Contract
from isoexec.tools.pair import handshake, make_prompts
from isoexec.tools.tiny_models import QWEN35_35B_A3B_TEXT, make_tiny_model
from isoexec.vllm.engine_process import EngineConfig, EngineProcess, SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer, pytest.mark.slow]

TEMPS = [1.0, 0.7]


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("qwen35_35b_shape")
    path = make_tiny_model("tiny-qwen35-moe", root / "ckpt", dtype="bfloat16",
                           overrides=QWEN35_35B_A3B_TEXT)  # fmt: skip
    yield str(path)
    for f in path.glob("*.safetensors"):  # 3.2 GB: not kept for the rest of the session
        f.unlink()


def test_35b_a3b_widths_trainer_equals_engine_bitwise(
    big_model: str, run_tp_jobs: Callable[..., list[dict[str, Any]]]
) -> None:
    prompts = [p[:48] for p in make_prompts(len(TEMPS), QWEN35_35B_A3B_TEXT["vocab_size"], 5)]
    specs = [SamplingSpec(max_tokens=4, temperature=t) for t in TEMPS]
    config = EngineConfig(model=big_model, dtype="bfloat16", isoexec=True, enforce_eager=True,
                          max_num_batched_tokens=64)  # fmt: skip
    with EngineProcess(config) as engine:
        sampled = engine.generate(prompts, specs)
        jobs = scoring_jobs(sampled, TEMPS, model=big_model, dtype="bfloat16", tp=1,
                            isoexec=True, contract=True, initialize=False)  # fmt: skip
        results = run_tp_jobs(jobs, [], nproc=1)
        contract = Contract.from_bytes(results[0]["contract"])
        assert contract.model.layer_kinds == ("linear_attention", "attention")
        tv, ev = handshake(contract, engine, run_id="35b-shape")
        assert tv.matched and ev["outcome"] == "MATCH", tv
    train, eng = aligned_logprobs(sampled, TEMPS, jobs, results)
    assert train.numel() == 8
    assert torch.equal(train, eng), (train - eng).abs().max()
    print(f"Qwen3.5-35B-A3B widths: {train.numel()}/{train.numel()} tokens bitwise")


def test_35b_a3b_checkpoint_has_the_release_widths(big_model: str) -> None:
    import json

    text = json.loads((Path(big_model) / "config.json").read_text())["text_config"]
    assert {k: text[k] for k in QWEN35_35B_A3B_TEXT} == QWEN35_35B_A3B_TEXT
