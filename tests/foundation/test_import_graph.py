"""The contract package declares neither framework, so it must never import one.

Two entry points are the exception: `isoexec pair` (`pair.py`, `pair_setup.py`,
`pair_steps.py`) and `isoexec bench` (`bench.py`) run a trainer and an engine side by side; they
import both lazily, inside functions, after `pair.missing_sides()` has named any missing package
(tests/contract/test_cli.py, tests/contract/test_bench.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

CONTRACT = Path(__file__).parents[2] / "packages" / "isoexec-contract" / "src" / "isoexec"
FORBIDDEN = ("megatron", "vllm", "isoexec.megatron", "isoexec.vllm")
PAIR_ENTRY = {"contract/pair.py", "contract/pair_setup.py", "contract/pair_steps.py",
              "contract/bench.py"}  # fmt: skip


def _imports(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, module, at module level) for every import in `tree`."""
    top = {id(n) for n in getattr(tree, "body", [])}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module, id(node) in top))
    return out


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def test_contract_package_never_imports_a_framework() -> None:
    files = sorted(CONTRACT.rglob("*.py"))
    assert len(files) > 20, files  # the scan sees the package
    offenders, pair_imports = [], []
    for path in files:
        rel = path.relative_to(CONTRACT).as_posix()
        for line, module, top_level in _imports(ast.parse(path.read_text(), str(path))):
            if not _forbidden(module):
                continue
            if rel in PAIR_ENTRY and not top_level:
                pair_imports.append(module)
            else:
                offenders.append(f"{rel}:{line} imports {module}")
    assert offenders == [], "\n".join(offenders)
    # The exception is real (so the scan would see a forbidden import if one were added).
    assert {"isoexec.megatron", "isoexec.vllm.engine_process"} <= set(pair_imports)


def test_scan_catches_a_forbidden_import() -> None:
    """Negative control: the same scan flags a module-level and a nested framework import."""
    tree = ast.parse("import vllm\ndef f():\n    from isoexec.megatron import score\n")
    found = [(m, top) for _, m, top in _imports(tree) if _forbidden(m)]
    assert found == [("vllm", True), ("isoexec.megatron", False)]
