"""Run the Triton kernel tests under Triton's interpreter, in a subprocess.

Why a subprocess: TRITON_INTERPRET must be set before triton is imported, it is read
process-wide, and vLLM / Megatron import triton as well; setting it in this process would
change every later test and leak into the engine subprocesses. The interpreter proves a
kernel's *structure* (a row's result does not depend on M, neighbours, decode split); its
bits say nothing about GPU bits (integration/gpu/run_checks.py checks those on CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _triton_testlib import CUDA, HAVE_TRITON

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODULES = ["test_kernels.py", "test_negative_controls.py", "test_paged_cache.py"]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CUDA, reason="a CUDA machine runs the kernel modules in-process on the GPU")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="already under the interpreter"
)
@pytest.mark.parametrize("module", MODULES)
def test_under_interpreter(module: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{module} under TRITON_INTERPRET=1 failed:\n{out[-6000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]
