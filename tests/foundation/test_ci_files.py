"""The GPU pipeline and CI entry cannot run here; check that what they reference exists."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    pipeline = yaml.safe_load((ROOT / "ci" / "gpu-pipeline.yml").read_text())
    return [
        step["run"] for job in pipeline["jobs"].values() for step in job["steps"] if "run" in step
    ]


def test_gpu_pipeline_references_real_files() -> None:
    cmds = _commands()
    assert cmds
    for cmd in cmds:
        for token in shlex.split(cmd):
            if re.match(
                r"^(docker|tests|integration|ci|scripts|benchmarks)/", token
            ) or token.endswith((".py", ".Dockerfile")):
                assert (ROOT / token).exists(), f"pipeline runs {cmd!r}: {token} is not in the repo"


def test_gpu_pipeline_runs_gpu_marked_tests() -> None:
    assert any("-m gpu" in c for c in _commands())
    ini = (ROOT / "pyproject.toml").read_text()
    assert '"gpu:' in ini  # the marker the pipeline selects is declared


def test_ci_runs_exactly_the_readme_commands() -> None:
    out = subprocess.run(
        [
            "bash",
            "-c",
            "source <(sed -n '/^readme_block()/,/^}/p' .ci/run); readme_block 1; readme_block 2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.+?)\n```", readme)
    assert out == blocks[:2]
    assert "uv" in out[0] and "pip install uv" in out[0]
    assert "pytest" in out[1]
