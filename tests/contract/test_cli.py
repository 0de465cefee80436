"""`isoexec contract …` and the dispatcher, through a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _contract_testlib import make_contract

ISOEXEC = Path(sys.executable).parent / "isoexec"
CMD = [str(ISOEXEC)] if ISOEXEC.exists() else [sys.executable, "-m", "isoexec.tools.cli"]


def isoexec(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    return {
        "a": make_contract(28).save(tmp_path / "a.json"),
        "a2": make_contract(28).save(tmp_path / "a2.json"),
        "b": make_contract(28, fc1_version={3: 4}).save(tmp_path / "b.json"),
        "dir": tmp_path,
    }


def test_help_lists_subcommands_and_runs_as_module() -> None:
    r = isoexec("--help")
    assert r.returncode == 0 and "contract" in r.stdout and "handshake" in r.stdout
    m = subprocess.run(
        [sys.executable, "-m", "isoexec.tools.cli", "contract", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert m.returncode == 0 and "diff" in m.stdout


def test_hash_prints_contract_hash(files: dict[str, Path]) -> None:
    r = isoexec("contract", "hash", str(files["a"]))
    assert r.returncode == 0 and r.stdout.strip() == make_contract(28).hash


def test_show_is_readable_and_json_round_trips(files: dict[str, Path]) -> None:
    r = isoexec("contract", "show", str(files["a"]))
    assert r.returncode == 0
    assert r.stdout.splitlines()[0] == f"hash      {make_contract(28).hash}"
    assert "layers.27.mlp.fc1" in r.stdout and "native:Embedding" in r.stdout
    j = isoexec("contract", "show", "--json", str(files["a"]))
    assert json.loads(j.stdout) == make_contract(28).to_dict()


def test_diff_exit_codes_and_first_line(files: dict[str, Path]) -> None:
    same = isoexec("contract", "diff", str(files["a"]), str(files["a2"]))
    assert same.returncode == 0 and "equal" in same.stdout
    d = isoexec("contract", "diff", str(files["a"]), str(files["b"]))
    assert d.returncode == 1
    assert d.stdout.splitlines()[0] == "layers.3.mlp.fc1 (linear): impl version 3 → 4"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        (b"{not json", "not valid JSON"),
        (b'{"schema_version":7}', "unknown contract schema_version 7"),
    ],
)
def test_bad_input_exits_2_with_one_line_error(
    files: dict[str, Path], content: bytes | None, message: str
) -> None:
    bad = files["dir"] / "bad.json"
    if content is not None:
        bad.write_bytes(content)
    r = isoexec("contract", "diff", str(files["a"]), str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("isoexec contract: error: ") and message in r.stderr


def test_usage_error_exits_2() -> None:
    r = isoexec("contract", "frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.parametrize(
    ("blocked", "named"),
    [("vllm", "isoexec-vllm[cpu] or isoexec-vllm[cuda]"), ("megatron", "isoexec-megatron")],
)
def test_pair_on_a_one_side_node_names_the_missing_package(blocked: str, named: str) -> None:
    """A node with one side installed (the README's recommended install): `isoexec pair` exits
    2 with one line naming what is missing. The other side is made unimportable with a meta
    path finder in a fresh interpreter, as if it were not installed."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {blocked!r} or name == 'isoexec.{blocked}':\n"
        "            raise ModuleNotFoundError(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
        "from isoexec.tools.cli import main\n"
        "sys.exit(main(['pair', '--out', sys.argv[1]]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "/tmp/isoexec-pair-one-side"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert lines == [
        "isoexec pair runs a trainer and an engine side by side and needs both sides "
        f"installed; missing: {named}"
    ]
