"""An implementation's source fingerprint covers every line it can execute.

A copy of `isoexec.contract` and `isoexec.ops` is imported in a fresh interpreter with one
helper edited: `silu_mul` in `isoexec/ops/activation.py`. The `silu_mul` op is that function;
`moe_combine` runs it from another module (fingerprints cover whole modules, the closure of
what an op's modules use). Both fingerprints must change; an op that never runs it
(`gdn_conv`) must not.
Negative control: a fingerprint of the op's listed entry functions alone (the previous rule)
misses the edit for `moe_combine`. (The C++ sources of compiled kernels are covered too:
tests/ops' `test_*fingerprint*` edit them.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "packages" / "isoexec-contract" / "src"

PROBE = """
import json, sys
from isoexec.contract.impl import source_fingerprint
from isoexec.ops import REGISTRY, _SPECS, activation
assert activation.__file__.startswith(sys.argv[1]), activation.__file__
out = {op: REGISTRY[op].source_fingerprint for op in ("silu_mul", "moe_combine", "gdn_conv")}
out["moe_combine_listed_only"] = source_fingerprint(*_SPECS["moe_combine"][3])
print(json.dumps(out))
"""


def _fingerprints(src: Path) -> dict[str, str]:
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-c", PROBE, str(src)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_editing_a_helper_changes_every_fingerprint_that_runs_it(tmp_path: Path) -> None:
    clean, edited = tmp_path / "clean", tmp_path / "edited"
    for d in (clean, edited):
        shutil.copytree(SRC, d, ignore=shutil.ignore_patterns("__pycache__"))
    act = edited / "isoexec" / "ops" / "activation.py"
    text = act.read_text()
    old = "def silu_mul(x: torch.Tensor) -> torch.Tensor:\n"
    assert old in text
    act.write_text(text.replace(old, old + "    x = x + 0.0  # an edit\n", 1))
    before, after = _fingerprints(clean), _fingerprints(edited)
    assert after["silu_mul"] != before["silu_mul"]
    assert after["moe_combine"] != before["moe_combine"]
    assert after["gdn_conv"] == before["gdn_conv"]
    assert after["moe_combine_listed_only"] == before["moe_combine_listed_only"]
