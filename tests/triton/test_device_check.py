"""integration/gpu/device_check.py, rehearsed on CPU: everything but CUDA.

The lent GPU machine gives a session 15 minutes in all, so the check must work the first time.
Here it runs end to end under Triton's interpreter at tiny sizes (a subprocess: the variable
is read when triton is imported), its rows reach `OUT` as they come, a row that finds a
difference fails the run (negative control), the carried Megatron-core wheel stays under the
device tool's 64 MiB carry limit, and the carried layout resolves under a Python 3.12 (the
device's version; the pyenv one here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _triton_testlib import CUDA, HAVE_TRITON

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / "integration" / "gpu"
SCRIPT = GPU_DIR / "device_check.py"
CARRY_LIMIT = 64 * 2**20

pytestmark = [
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed"),
    pytest.mark.skipif(CUDA, reason="a CUDA machine runs the check itself, not its rehearsal"),
]


def _python312() -> str:
    for cand in sorted(Path(os.path.expanduser("~/.pyenv/versions")).glob("3.12*/bin/python3.12")):
        return str(cand)
    pytest.fail("no Python 3.12 under ~/.pyenv: the device's Python cannot be rehearsed")


@pytest.fixture(scope="module")
def wheels() -> Path:
    """The wheel folder as `fetch_wheels.sh` fills it (from the package registry)."""
    proc = subprocess.run(
        ["bash", str(GPU_DIR / "fetch_wheels.sh")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return GPU_DIR / "wheels"


def test_the_carried_wheels_fit_the_carry_limit(wheels: Path) -> None:
    files = list(wheels.glob("*.whl"))
    assert [f.name.split("-")[0] for f in files] == ["megatron_core"], files
    assert all("cp312" in f.name and "manylinux" in f.name for f in files), files
    size = sum(f.stat().st_size for f in files)
    print(f"carried wheels: {size / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f}")
    assert size < CARRY_LIMIT // 4  # the working tree travels in the same 64 MiB


def test_the_carried_layout_resolves_under_python_312(wheels: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [_python312(), str(SCRIPT), "--check-import-path", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[0])
    assert found["megatron.core"].startswith(str(tmp_path / "site-packages"))
    assert str(ROOT / "packages" / "isoexec-megatron" / "src") in found["isoexec"]
    # Every carried source compiles under 3.12 (no 3.11-only syntax reaches the device).
    sources = [str(ROOT / "packages" / p / "src") for p in ("isoexec-contract", "isoexec-megatron")]
    compiled = subprocess.run(
        [_python312(), "-m", "compileall", "-q", "-d", "/x", *sources, str(GPU_DIR)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")},
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr


def _interpreted(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1", "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.matrix  # 200 s under the interpreter: run it before a GPU session (README)
def test_dry_run_under_the_interpreter(wheels: Path, tmp_path: Path) -> None:
    proc = _interpreted(
        str(SCRIPT), "--device", "cpu", "--dry-run", "--scale", "1",
        "--kernels", "linear,moe_combine", "--dtypes", "float32", "--budget-s", "1500",
        # One family keeps CI short: the hybrid (GDN + gated attention; dense is the negative
        # control's; MoE's decode is tests/megatron/test_engine_style.py's, torch backend).
        "--families", "tiny-gdn", out=tmp_path,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    by = {f"{r['section']} {r['name']}": r for r in rows}
    assert "megatron-core 0.16.1 from " + str(tmp_path / "site-packages") in text
    truncation = by["kernel truncation"]
    assert truncation["result"] == "PASS" and "equal to the CPU's True" in truncation["detail"]
    for name in ("kernel linear", "kernel moe_combine", "trainer tp_leaves float32"):
        assert by[name]["result"] == "PASS", by[name]
    for fam in ("tiny-gdn",):
        row = by[f"trainer {fam} float32"]
        assert row["result"] == "PASS" and "['triton']" in row["detail"], row
        row = by[f"engine-style {fam} float32"]
        assert row["result"] == "PASS" and "2/2 seqs bitwise" in row["detail"], row
    bi = by["speed trainer tiny-dense / upstream-bi"]
    assert bi["result"] == "SKIP" and "CUDA-only" in bi["detail"], bi
    assert (tmp_path / "table.txt").read_text().count("\n") == len(rows) + 2


NEGATIVE = """
import sys, torch
from pathlib import Path
sys.path.insert(0, "integration/gpu")
import device_check as dc
out = Path(sys.argv[1])
dc.check_import_path(out / "site-packages")
import isoexec.megatron.scoring as scoring
real = scoring.score
def packed_off_by_one_ulp(model, seqs, *a, **k):
    lps = real(model, seqs, *a, **k)
    if len(seqs) > 1:  # packing changes the bits: what IsoExec exists to prevent
        lps[0] = torch.nextafter(lps[0], torch.full_like(lps[0], float("inf")))
    return lps
scoring.score = packed_off_by_one_ulp
row, _ = dc.trainer_rows("tiny-dense", "float32", "cpu", out / "models", True)
print("ROW", row.result, row.detail)
"""


def test_a_difference_fails_the_trainer_row(wheels: Path, tmp_path: Path) -> None:
    """Negative control: one ulp in a packed sequence's logprobs makes the row FAIL."""
    proc = _interpreted("-c", NEGATIVE, str(tmp_path), out=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "ROW FAIL" in text and "'packed': False" in text, text[-2000:]
