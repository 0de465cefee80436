"""The GPU pipeline and CI entry cannot run here; check that what they reference exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
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


def test_gpu_marker_on_the_command_line_replaces_addopts(tmp_path: Path) -> None:
    """The pipeline's `pytest -m gpu` against pyproject's addopts (`-m 'not matrix'`): the later
    `-m` wins, so every gpu-marked test is selected, matrix cells included, and nothing else."""
    (tmp_path / "test_sel.py").write_text(
        "import pytest\n"
        "def test_cpu(): pass\n"
        "@pytest.mark.matrix\ndef test_cpu_matrix(): pass\n"
        "@pytest.mark.gpu\ndef test_gpu(): pass\n"
        "@pytest.mark.gpu\n@pytest.mark.matrix\ndef test_gpu_matrix(): pass\n"
    )
    cmd = next(c for c in _commands() if "pytest" in c and "-m gpu" in c)
    args = shlex.split(cmd)
    marker = args[len(args) - 1 - args[::-1].index("-m") + 1]  # the last -m (not `python -m`)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
         str(tmp_path), "-p", "no:cacheprovider", "-p", "no:xdist", "--co", "-q",
         "-m", marker, str(tmp_path / "test_sel.py")],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    selected = sorted(ln.split("::")[-1] for ln in out.stdout.splitlines() if "::" in ln)
    assert selected == ["test_gpu", "test_gpu_matrix"], out.stdout + out.stderr


def test_gpu_pipeline_builds_every_image_from_the_one_base() -> None:
    builds = [c for c in _commands() if c.startswith("docker build")]
    assert builds[0] == "docker build -f docker/base.Dockerfile -t isoexec-base ."
    for name in ("ci", "trainer", "engine"):
        assert any(f"-f docker/{name}.Dockerfile --build-arg BASE=isoexec-base" in c
                   for c in builds[1:]), name  # fmt: skip


def test_gpu_pipeline_pair_rows_run_triton_on_cuda() -> None:
    pairs = [shlex.split(c) for c in _commands() if "isoexec pair" in c]
    presets = set()
    for args in pairs:
        i = args.index("pair")
        opts = dict(zip(args[i + 1 :: 2], args[i + 2 :: 2], strict=False))
        assert opts.get("--backend") == "triton" and opts.get("--device") == "cuda", args
        assert "--gpus" in args, args
        presets.add(opts["--preset"])
    assert {"tiny-dense", "tiny-moe", "tiny-gdn"} <= presets


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
