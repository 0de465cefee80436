"""The layout holds: every import goes down a layer or stays in its own, the two sides never
import each other, no framework-free layer imports a framework, and no module imports itself
back through others (`isoexec.tools.layout`; no whitelist). Negative controls: the same checks
on a made graph flag an upward import, a cross-side import, a framework in `contract`, a lazy
import and a cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from isoexec.tools.layout import (
    Edge,
    cycles,
    edges,
    imports,
    modules,
    package_roots,
    violations,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_scan_sees_all_three_distributions() -> None:
    roots = {p.relative_to(ROOT).as_posix() for p in package_roots()}
    assert roots == {f"packages/isoexec-{d}/src/isoexec" for d in ("contract", "megatron", "vllm")}
    mods = modules(package_roots())
    for layer in ("contract", "ops", "handshake", "tools", "megatron", "vllm"):
        assert sum(m.startswith(f"isoexec.{layer}.") for m in mods) >= 5, layer


def test_no_upward_import_no_cross_side_import_no_cycle() -> None:
    graph = edges(modules(package_roots()))
    assert len(graph) > 300, len(graph)  # the scan sees the graph
    assert violations(graph) == []
    assert cycles(graph) == []
    # Only the tools import both sides; the sides import their frameworks.
    both = {e.imported.split(".")[1] for e in graph if e.importer.startswith("isoexec.tools.")}
    assert {"megatron", "vllm"} <= both


def test_the_layout_command_prints_the_graph_and_passes() -> None:
    out = subprocess.run([sys.executable, "-m", "isoexec.tools.layout"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "upward or cross imports: 0" in out.stdout and "import cycles: 0" in out.stdout


def test_negative_controls_each_bad_import_is_flagged(tmp_path: Path) -> None:
    bad = [
        Edge("isoexec.contract.sites", "isoexec.ops.gemm", 3),  # up
        Edge("isoexec.megatron.scoring", "isoexec.vllm.logprobs", 4),  # across sides
        Edge("isoexec.ops.gemm", "vllm", 5),  # a framework below the sides
        Edge("isoexec.vllm.layers", "megatron", 6),  # the other side's framework
    ]
    found = violations(bad)
    assert len(found) == 4, found
    loop = [Edge("isoexec.ops.a", "isoexec.ops.b", 1), Edge("isoexec.ops.b", "isoexec.ops.a", 2)]
    assert cycles(loop) == [["isoexec.ops.a", "isoexec.ops.b"]]
    # A lazy import counts; one under `if TYPE_CHECKING:` does not (never executed).
    src = tmp_path / "isoexec" / "contract" / "m.py"
    src.parent.mkdir(parents=True)
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n"
                   "def f():\n    from isoexec.megatron import score\n")  # fmt: skip
    found_imports = {m for m, _ in imports("isoexec.contract.m", src)}
    assert "isoexec.megatron" in found_imports and "vllm" not in found_imports


def test_the_architecture_doc_carries_the_generated_layer_table() -> None:
    """docs/architecture.md's layer table is exactly what the tool generates (a module added,
    moved or removed without regenerating it fails here)."""
    from isoexec.tools.layout import DOC_BEGIN, DOC_END, markdown

    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert DOC_BEGIN in doc and DOC_END in doc
    block = doc[doc.index(DOC_BEGIN) : doc.index(DOC_END) + len(DOC_END)]
    assert block == markdown(modules(package_roots())), (
        "regenerate with `python scripts/gen_docs.py`"
    )


def test_every_file_stays_at_500_lines_or_fewer() -> None:
    """Small modules with one job: no tracked Python file over 500 lines (generated protobuf
    code excepted). Negative control: the count sees this repository's largest files."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    files = [ROOT / f for f in out.stdout.split() if "/_gen/" not in f]
    assert len(files) > 200, len(files)
    sizes = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in files}
    assert max(sizes.values()) > 400  # the scan reads real files
    assert {f: n for f, n in sizes.items() if n > 500} == {}
