"""IsoExec's sampler is the V1 model runner's; on CUDA vLLM 0.32 defaults to Model Runner V2,
which builds its own. Installing the sampler selects the V1 runner unless the user chose V2
explicitly (then the logprobs site reads back native: the handshake refuses). Checked in a
fresh process, as vLLM's plugin loader runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
from isoexec.vllm.logprobs import IsoSampler, install_sampler
install_sampler()
import vllm.envs as envs
import vllm.v1.worker.gpu_model_runner as runner
print(runner.Sampler is IsoSampler, envs.VLLM_USE_V2_MODEL_RUNNER)
"""


@pytest.mark.parametrize(
    ("preset", "expected"),
    [(None, "True False"), ("1", "True True"), ("0", "True False")],
)
def test_install_sampler_selects_the_v1_runner_unless_v2_was_asked_for(
    preset: str | None, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    if preset is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = preset
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == expected
