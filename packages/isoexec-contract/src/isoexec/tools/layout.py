"""The import graph of IsoExec, by layer: `python -m isoexec.tools.layout`.

The layers, bottom up (a module may import its own layer and the ones below, never above):

    0 contract   schema, hash, diff, fingerprints, parallel layout, options   (no framework)
    1 ops        the canonical numerics, C++ and Triton kernels                (no framework)
    2 handshake  the gRPC service, client, TLS, rendezvous, served protocol    (no framework)
    3 megatron, vllm   the two sides: each imports layers 0-2, never the other side
    4 tools      pair, bench, locate, tiny models, the CLI: imports both sides
    5 ray        trainer ranks and engines as Ray actors across nodes (the `ray` extra)

Every import counts, also the ones inside functions: a lazy import is still a dependency, and
hiding a cycle in a function is how the layout rotted before. The scan reads source (`ast`), so
it needs neither framework installed.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

LAYERS: dict[str, int] = {
    "contract": 0,
    "ops": 1,
    "handshake": 2,
    "megatron": 3,
    "vllm": 3,
    "tools": 4,
    "ray": 5,
}
FRAMEWORKS = ("megatron", "vllm")  # third-party top-level packages only the sides may import


@dataclass(frozen=True)
class Edge:
    """`importer` imports `imported` (both dotted module names) at `line`."""

    importer: str
    imported: str
    line: int


def package_roots() -> list[Path]:
    """The directories that hold the `isoexec` namespace (one per distribution)."""
    import isoexec

    return sorted(Path(p) for p in isoexec.__path__)


def modules(roots: Iterable[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every module under the `isoexec` namespace roots
    (generated protobuf code included: it is imported like any other module)."""
    out: dict[str, Path] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (annotations only: never executed, so no dependency at run time)."""
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(module, line) for every import in the file, also the ones inside functions (but not
    the ones under `if TYPE_CHECKING:`). A `from pkg import sub` names `pkg.sub` too, which
    counts when that is a module (checked by the caller)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}  # fmt: skip
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node)
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def edges(mods: Mapping[str, Path]) -> list[Edge]:
    """Edges between IsoExec modules, and to the frameworks (as `megatron`/`vllm`)."""
    out: set[Edge] = set()
    for name, path in mods.items():
        for target, line in imports(name, path):
            top = target.split(".")[0]
            if top in FRAMEWORKS:
                out.add(Edge(name, top, line))
            elif target in mods and target != name and not name.startswith(target + "."):
                out.add(Edge(name, target, line))  # a package's own __init__ is not a dep
    return sorted(out, key=lambda e: (e.importer, e.imported, e.line))


def layer_of(module: str) -> tuple[str, int] | None:
    """(layer name, rank) of an IsoExec module; None for a module outside every layer."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "isoexec" or parts[1] not in LAYERS:
        return None
    return parts[1], LAYERS[parts[1]]


def violations(graph: Iterable[Edge]) -> list[str]:
    """Each import that goes up a layer, across the two sides, or from a framework-free
    layer (0-2) to a framework."""
    out = []
    for e in graph:
        src = layer_of(e.importer)
        if src is None:
            out.append(f"{e.importer} is in no layer")
            continue
        if e.imported in FRAMEWORKS:
            if src[1] != 3 or src[0] != e.imported:
                out.append(f"{e.importer}:{e.line} imports the framework {e.imported}")
            continue
        dst = layer_of(e.imported)
        if dst is None:
            out.append(f"{e.importer}:{e.line} imports {e.imported}, which is in no layer")
        elif dst[1] > src[1]:
            out.append(f"{e.importer}:{e.line} imports {e.imported}: up from {src[0]} to {dst[0]}")
        elif dst[1] == src[1] and dst[0] != src[0]:
            out.append(f"{e.importer}:{e.line} imports {e.imported}: across from {src[0]}")
    return out


def cycles(graph: Iterable[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), sorted."""
    succ: dict[str, set[str]] = {}
    for e in graph:
        if e.imported not in FRAMEWORKS:
            succ.setdefault(e.importer, set()).add(e.imported)
            succ.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(succ):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def report(graph: list[Edge]) -> str:
    """The layer-to-layer import counts, then every violation and cycle."""
    counts: dict[tuple[str, str], int] = {}
    for e in graph:
        src = layer_of(e.importer)
        dst = (f"{e.imported}(framework)", -1) if e.imported in FRAMEWORKS else layer_of(e.imported)
        if src and dst:
            counts[src[0], dst[0]] = counts.get((src[0], dst[0]), 0) + 1
    order = sorted(LAYERS, key=lambda n: (LAYERS[n], n))
    lines = ["layer      imports (count of module-to-module imports)"]
    for name in order:
        names = [*order, *(f"{f}(framework)" for f in FRAMEWORKS)]
        targets = [f"{t} {counts[name, t]}" for t in names if (name, t) in counts]
        lines.append(f"{LAYERS[name]} {name:<9} {', '.join(targets) or '-'}")
    bad, loops = violations(graph), cycles(graph)
    lines.append(f"upward or cross imports: {len(bad)}")
    lines += [f"  {v}" for v in bad]
    lines.append(f"import cycles: {len(loops)}")
    lines += [f"  {' <-> '.join(c)}" for c in loops]
    return "\n".join(lines)


_LAYER_JOBS = {
    "contract": "schema, hash, diff, fingerprints, parallel layout, options (no framework)",
    "ops": "the canonical numerics, C++ and Triton kernels (no framework)",
    "handshake": "the gRPC service, client, TLS, rendezvous, served protocol (no framework)",
    "megatron": "the trainer side (imports Megatron-core)",
    "vllm": "the engine side (imports vLLM)",
    "tools": "pair, bench, locate, tiny models, the CLI: imports both sides",
    "ray": "trainer ranks, engines and the handshake service as Ray actors across nodes; weight "
    "sync through the object store (the `ray` extra)",
}
DOC_BEGIN = "<!-- generated by `python -m isoexec.tools.layout --markdown`: do not edit -->"
DOC_END = "<!-- end of generated layout -->"


def markdown(mods: Mapping[str, Path]) -> str:
    """The layer table for docs/architecture.md: each layer, its job, its modules."""
    rows = [DOC_BEGIN, "", "| layer | namespace | what it holds | modules |", "|---|---|---|---|"]
    for name in sorted(LAYERS, key=lambda n: (LAYERS[n], n)):
        prefix = f"isoexec.{name}."
        members = sorted(m.removeprefix(prefix) for m in mods if m.startswith(prefix))
        shown = ", ".join(f"`{m}`" for m in members if "._gen" not in f".{m}")
        rows.append(f"| {LAYERS[name]} | `isoexec.{name}` | {_LAYER_JOBS[name]} | {shown} |")
    return "\n".join([*rows, "", DOC_END])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    mods = modules(package_roots())
    if args == ["--markdown"]:
        print(markdown(mods))
        return 0
    if args:
        print("usage: python -m isoexec.tools.layout [--markdown]", file=sys.stderr)
        return 2
    graph = edges(mods)
    print(report(graph))
    return 1 if violations(graph) or cycles(graph) else 0


if __name__ == "__main__":
    raise SystemExit(main())
