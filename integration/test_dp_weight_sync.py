"""A DP=2 trainer step (torchrun, 2 ranks) → export → weight sync through the gate → the
engine is bitwise equal to the trainer again.

The DP=2 step's weights are bitwise those of DP=1 (`tests/megatron/test_dp.py`); here they
travel the user's path: the trainer's contract MATCHes the engine at the handshake, the
exported HF tensors are loaded only if they hash to the trainer's fingerprint, and then the
engine's logprobs of the batch equal the trained trainer's, bit for bit. Before the sync they
do not (the engine still holds the old weights): the comparison can fail.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from isoexec.contract.contract import Contract
from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.handshake.server import HandshakeServer
from isoexec.tools.pair import handshake
from isoexec.vllm.engine_process import SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

SEQS = [
    [3, 17, 250, 9, 44, 101, 7, 8, 9, 10],
    [5, 5, 480, 2, 7, 7, 1, 2],
    [11, 300, 77, 61, 499, 23, 8, 90, 151, 4, 0, 5],
    [6, 7, 8, 9, 10, 11, 12, 13, 14],
]


def _engine_logprobs(engine: Any) -> list[torch.Tensor]:
    outs = engine.generate(SEQS, SamplingSpec(max_tokens=1, prompt_logprobs=True))
    return [torch.tensor(o.prompt_logprobs, dtype=torch.float32) for o in outs]


def test_dp2_step_syncs_to_the_engine_bitwise(
    tmp_path: Path,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = model_factory("tiny-dense", "float32")
    job = dict(model=model, dtype="float32", tp=1, isoexec=True, train=True,
               export_after_step=True, max_tokens=20, contract=True)  # fmt: skip
    (trained,) = run_tp_jobs([job], SEQS, nproc=2)  # DP=2
    # A dedicated engine (seed 7): its weights change, so no other test may share it.
    engine = engine_pool(model=model, isoexec=True, seed=7, enforce_eager=True)
    token = secrets.token_hex(16)
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:  # the gate asks it
        contract = Contract.from_bytes(trained["contract"])
        trainer_verdict, engine_verdict = handshake(
            contract, engine, "dp2-sync", server=server, token=token
        )
        assert trainer_verdict.matched and engine_verdict["outcome"] == "MATCH"
        assert not all(
            torch.equal(a, b)
            for a, b in zip(_engine_logprobs(engine), trained["logprobs_after_step"], strict=True)
        )  # the engine still holds the weights before the step

        weights = trained["weights_after_step"]
        path = tmp_path / "dp2-step.safetensors"
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
        sent = WeightFingerprint.of(weights).digest
        assert engine.call("load_weights", str(path), sent) == [sent]
    after = _engine_logprobs(engine)
    assert all(
        torch.equal(a, b) for a, b in zip(after, trained["logprobs_after_step"], strict=True)
    )
