"""integration/gpu/run_checks.py is safe to call anywhere and survives a failing row."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _triton_testlib import CUDA, HAVE_TRITON

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "integration" / "gpu" / "run_checks.py"


def _run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(CUDA, reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_it_says_so_and_exits_0() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_table_and_per_row_failure_under_the_interpreter() -> None:
    # a bogus family must become one ERROR row, not kill the table (exit 2: error, not
    # invariance)
    proc = _run(
        "--device", "cpu", "--scale", "1", "--kernels", "linear", "--families", "nope",
        interpret=True,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    lines = out.splitlines()
    assert any(line.startswith("kernel linear") and " PASS " in line for line in lines), out
    assert any(line.startswith("pair nope") and " ERROR " in line for line in lines), out


def test_pair_rows_call_run_arm_as_it_is_today(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair section drives `isoexec.tools.pair.run_arm` with a `PairRun` (a signature
    drift would only show on the GPU, where every try counts). No engine: run_arm is faked."""
    import time
    from types import SimpleNamespace

    from isoexec.tools import pair

    sys.path.insert(0, str(SCRIPT.parent))
    import run_checks

    calls = []

    def fake_run_arm(run: pair.PairRun, *, isoexec: bool) -> SimpleNamespace:
        calls.append((run, isoexec))
        return SimpleNamespace(bitwise_equal=5, tokens=5, max_abs_diff=0.0, handshake="MATCH")

    monkeypatch.setattr(pair, "run_arm", fake_run_arm)
    rows = run_checks.pair_rows(["tiny-dense"], "float32", time.monotonic() + 60, False, "cpu")
    assert [r.result for r in rows] == ["PASS"], rows
    ((run, iso),) = calls
    assert iso and run.backend == "triton" and run.device == "cpu" and run.dtype == "float32"
