"""Run pytest on test files in a subprocess under Triton's interpreter.

Why a subprocess: TRITON_INTERPRET must be set before triton is imported, it is read
process-wide, and vLLM / Megatron import triton as well; setting it in the test process would
change every later test and leak into the engine subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pytest_under_interpreter(*args: str, timeout: int = 600) -> str:
    """`python -m pytest -q ARGS` with TRITON_INTERPRET=1 from the repository root: its output,
    after asserting that it passed and that nothing it selected was skipped."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} under TRITON_INTERPRET=1:\n{out[-6000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]
    return out
