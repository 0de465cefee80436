"""The trainer's side of the canonical penalties (`isoexec.ops.penalties`): scoring with them
does not depend on packing, micro-batching or padding (each row's history is its own
sequence's), the native path computes the same rule, and the torchrun job's JSON carries them
unchanged. The engine side and the bitwise comparison: tests/vllm/test_sampler_penalties.py,
integration/test_trainer_engine.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from isoexec.megatron.distributed_scoring import _penalties
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.scoring import policy_logprobs, score
from isoexec.megatron.weights import load_hf_weights
from isoexec.ops.penalties import Penalties

pytestmark = pytest.mark.trainer

PENALTIES = Penalties.of(1.3, 0.4, 0.2, {3: 2.0, 40: -1.5}, list(range(0, 128, 3)))


def _model(ckpt: Path, isoexec: bool) -> torch.nn.Module:
    model = build_model(ckpt, isoexec=isoexec)
    load_hf_weights(model, ckpt)
    return model


def _allowed(sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sequences with every token on the allow-list (0 and multiples of 3)."""
    return [torch.where(s % 3 == 0, s, 0) for s in sequences]


def test_penalised_scores_do_not_depend_on_packing_and_change_the_logprobs(
    parallel: object, qwen3_dir: Path, sequences: list[torch.Tensor]
) -> None:
    model = _model(qwen3_dir, isoexec=True)
    seqs = _allowed(sequences)
    lens = [1, 4, 10]
    one = score(model, seqs, 0.8, penalties=PENALTIES, prompt_lens=lens)
    for kw in ({"max_tokens": 1}, {"max_tokens": 12, "pad_to_multiple": 16}):
        split = score(model, seqs, 0.8, penalties=PENALTIES, prompt_lens=lens, **kw)
        assert all(torch.equal(a, b) for a, b in zip(one, split, strict=True)), kw
    graph = policy_logprobs(model, seqs, 0.8, penalties=PENALTIES, prompt_lens=lens)
    assert all(torch.equal(a, b.detach()) for a, b in zip(one, graph, strict=True))
    plain = score(model, seqs, 0.8)
    assert all(not torch.equal(a, b) for a, b in zip(one, plain, strict=True))  # control


def test_the_native_path_applies_the_same_rule(
    parallel: object, qwen3_dir: Path, sequences: list[torch.Tensor]
) -> None:
    """Stock Megatron scoring (the stock arm) applies the canonical rule too, so a stock arm's
    difference is the model's kernels, not the penalties."""
    lens = [1, 4, 10]
    seqs = _allowed(sequences)
    model = _model(qwen3_dir, isoexec=False)
    native = score(model, seqs, 1.0, penalties=PENALTIES, prompt_lens=lens)
    plain = score(model, seqs, 1.0)
    assert all(not torch.equal(a, b) for a, b in zip(native, plain, strict=True))
    assert all(bool(torch.isfinite(a).all()) for a in native)


def test_the_torchrun_job_carries_the_penalties_unchanged() -> None:
    assert _penalties(json.loads(json.dumps(asdict(PENALTIES)))) == PENALTIES
    assert _penalties(None) is None
