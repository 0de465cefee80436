"""Regenerate the generated tables of docs/architecture.md (the layer table and the patch table);
tests/foundation/test_import_graph.py and tests/contract/test_patching.py check them."""

from __future__ import annotations

from pathlib import Path

from isoexec.contract import patch_table
from isoexec.tools import layout

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _replace(text: str, begin: str, end: str, block: str) -> str:
    i, j = text.index(begin), text.index(end) + len(end)
    return text[:i] + block + text[j:]


def main() -> None:
    text = DOC.read_text()
    text = _replace(text, layout.DOC_BEGIN, layout.DOC_END,
                    layout.markdown(layout.modules(layout.package_roots())))  # fmt: skip
    text = _replace(text, patch_table.DOC_BEGIN, patch_table.DOC_END, patch_table.markdown())
    DOC.write_text(text)
    print(f"regenerated the tables of {DOC}")


if __name__ == "__main__":
    main()
