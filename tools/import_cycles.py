"""Find import cycles between the modules of a package; exits 1 and prints them if any.

Every ``import`` / ``from ... import`` in a module counts (at module level or inside a
function, since a lazy import is still a dependency), except those under ``if TYPE_CHECKING:``.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
A package's ``__init__`` re-exporting its own submodules is not a cycle (that is what an
``__init__`` is for), so edges from an ``__init__`` into its own package are left out.

Usage: ``python tools/import_cycles.py adam_dask``
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = base.split(".")
                    parts = parts[: len(parts) - (child.level - 1)]
                    mod = ".".join(parts + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for a in child.names:
                    full = f"{mod}.{a.name}"
                    found.add(full if full in known else mod)
            visit(child)

    visit(tree)
    deps = {d for d in found if d in known and d != name}
    if is_pkg:
        deps = {d for d in deps if not d.startswith(name + ".")}
    return deps


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def main(argv: list[str]) -> int:
    package = argv[1] if len(argv) > 1 else "adam_dask"
    root = Path.cwd()
    known = modules(root, package)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found = cycles(graph)
    for comp in found:
        print("import cycle: " + " <-> ".join(comp))
    edges = sum(len(v) for v in graph.values())
    print(f"{len(known)} modules, {edges} internal imports, {len(found)} cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
