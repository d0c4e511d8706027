"""The house's structural rules, checked; exits 1 and prints every breach.

* **No import cycle** between the package's modules, type-only imports (under
  ``if TYPE_CHECKING:``) included: a cycle that only types see is still two modules that can
  not be read apart. Every ``import`` / ``from ... import`` counts (at module level or inside a
  function: a lazy import is still a dependency). ``from pkg import name`` is an edge to
  ``pkg.name`` when that is a module, else to ``pkg``. A package's ``__init__`` re-exporting its
  own submodules is not a cycle, so edges from an ``__init__`` into its own package are left
  out.
* **No import cycle between packages**: package A's modules import package B's and B's import
  A's (through any chain of packages). A module belongs to the package of its directory, so a
  package's own modules and its subpackages' are apart: a module ``adam_dask/x.py`` importing
  ``adam_dask.dashboard`` while the dashboard imports ``adam_dask.config`` is a cycle (so the
  embedded cluster, which registers the dashboard, is the package ``adam_dask/cluster/``). As
  above, a package's ``__init__`` re-exporting its own children is left out. Each cycle is
  printed with one import per edge inside it.
* **No import of a module of the package that does not exist** (mypy is told to ignore missing
  imports, for the third-party libraries without types, so it would not say).
* **No private module reached from another package**: ``a/b/_c.py`` is imported only from
  inside ``a/b/``; what packages share is public in its package.
* **No module over 500 lines**, numba kernel files excepted (``LONG_OK``: a kernel file is a set
  of forward/backward pairs that read best side by side; docs/design.md says so).
* **No mixin split across files**: a class of the package inherits from another class of the
  package only when that base is a real kind of thing (``BASES_OK``: exceptions, the protocol's
  ``Event`` / ``Action``, ...), never a bag of methods that reads attributes declared elsewhere.

Breaches not yet mended are listed in ``tools/structure-known.txt``, one per line as this
tool prints them: they are reported but do not fail; a new breach fails, and so does a listed
one that is gone (take it off the list: the list only shrinks).

Usage: ``python tools/structure.py adam_dask``
"""

from __future__ import annotations

import ast
import re
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


def from_module(base: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved against the package
    ``base`` of the importing module."""
    if not node.level:
        return node.module or ""
    parts = base.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                mod = from_module(base, child)
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


def package_of(name: str, known: dict[str, Path]) -> str:
    """The package a module belongs to: its directory's (a package's ``__init__``: itself)."""
    return name if known[name].name == "__init__.py" else name.rpartition(".")[0]


def package_graph(graph: dict[str, set[str]], known: dict[str, Path]) -> dict[str, set[str]]:
    """{package: the other packages its modules import}."""
    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        a = package_of(name, known)
        out.setdefault(a, set())
        for d in deps:
            b = package_of(d, known)
            out.setdefault(b, set())
            if a != b:
                out[a].add(b)
    return out


def package_cycles(
    graph: dict[str, set[str]], known: dict[str, Path]
) -> list[tuple[str, list[str]]]:
    """(``a <-> b <-> ...``, one ``module -> module`` import for each package edge inside it)
    for each cycle between packages."""
    out = []
    for comp in cycles(package_graph(graph, known)):
        inside, seen, via = set(comp), set(), []
        for name in sorted(graph):
            a = package_of(name, known)
            for d in sorted(graph[name]):
                b = package_of(d, known)
                if a != b and a in inside and b in inside and (a, b) not in seen:
                    seen.add((a, b))
                    via.append(f"{name} -> {d}")
        out.append((" <-> ".join(comp), via))
    return out


MAX_LINES = 500
LONG_OK = {"adam_dask.model.kernels"}  # numba forward/backward pairs, read side by side
BASES_OK = {
    "adam_dask.errors.AdamError",
    "adam_dask.ps.protocol.messages.Event",
    "adam_dask.ps.protocol.messages.Action",
}


def missing_modules(root: Path, package: str, known: dict[str, Path]) -> list[str]:
    """``importer: module`` for each import of a module of ``package`` that is not there."""
    out = []
    for name, path in known.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods: list[str] = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [from_module(base, node)]
            for m in mods:
                if (m == package or m.startswith(package + ".")) and m not in known:
                    out.append(f"{name}: {m} (line {node.lineno})")
    return sorted(out)


def private_reaches(graph: dict[str, set[str]], known: dict[str, Path]) -> list[str]:
    """``importer -> module`` for each private module imported from outside its package."""
    out = []
    for name, deps in graph.items():
        importer_pkg = name if known[name].name == "__init__.py" else name.rpartition(".")[0]
        for d in deps:
            parts = d.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    home = ".".join(parts[:i])
                    if importer_pkg != home and not importer_pkg.startswith(home + "."):
                        out.append(f"{name} -> {d}")
                    break
    return sorted(out)


def long_modules(known: dict[str, Path]) -> list[str]:
    out = []
    for name, path in known.items():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and name not in LONG_OK:
            out.append(f"{name}: {n} lines")
    return sorted(out)


def mixins(known: dict[str, Path]) -> list[str]:
    """``Class(Base)`` where ``Base`` is a class of the package in another module and not a real
    kind of thing (``BASES_OK``, or a subclass of one)."""
    classes: dict[str, tuple[str, list[str]]] = {}  # qualified name -> (module, base names)
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        local: dict[str, str] = {}  # a name in this module -> the qualified name it stands for
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = from_module(base, node)
                for a in node.names:
                    local[a.asname or a.name] = f"{mod}.{a.name}"
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = []
                for b in node.bases:
                    if isinstance(b, ast.Name):
                        bases.append(local.get(b.id, f"{name}.{b.id}"))
                classes[f"{name}.{node.name}"] = (name, bases)

    def ok(q: str) -> bool:
        if q in BASES_OK:
            return True
        entry = classes.get(q)
        return entry is not None and any(ok(b) for b in entry[1])

    out = []
    for q, (mod, bases) in classes.items():
        for b in bases:
            if b in classes and classes[b][0] != mod and not ok(b):
                out.append(f"{q}({b.rpartition('.')[2]}) from {classes[b][0]}")
    return sorted(out)


def main(argv: list[str]) -> int:
    package = argv[1] if len(argv) > 1 else "adam_dask"
    root = Path.cwd()
    known = modules(root, package)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    breaches = [
        *("import cycle: " + " <-> ".join(comp) for comp in cycles(graph)),
        *("package import cycle: " + c for c, _ in package_cycles(graph, known)),
        *("import of a missing module: " + m for m in missing_modules(root, package, known)),
        *(
            "private module reached from another package: " + p
            for p in private_reaches(graph, known)
        ),
        *(f"module over {MAX_LINES} lines: {m}" for m in long_modules(known)),
        *("mixin split across files: " + m for m in mixins(known)),
    ]
    known_file = Path(__file__).with_name("structure-known.txt")
    listed = set()
    if known_file.exists():
        listed = {
            ln.strip() for ln in known_file.read_text().splitlines() if ln.strip() and ln[0] != "#"
        }

    def key(b: str) -> str:  # a long module is the same breach whatever its count of lines
        return re.sub(r": \d+ lines$", "", b)

    listed_keys = {key(b) for b in listed}
    new = [b for b in breaches if key(b) not in listed_keys]
    gone = sorted(listed_keys - {key(b) for b in breaches})
    via = {"package import cycle: " + c: v for c, v in package_cycles(graph, known)}
    for b in breaches:
        print(("NEW  " if b in new else "known ") + b)
        if b in new:
            for edge in via.get(b, ()):
                print("       via " + edge)
    for b in gone:
        print("GONE " + b + "  (mended: take it off tools/structure-known.txt)")
    edges = sum(len(v) for v in graph.values())
    print(
        f"{len(known)} modules, {edges} internal imports, {len(breaches)} breach(es): "
        f"{len(new)} new, {len(breaches) - len(new)} known, {len(gone)} mended but still listed"
    )
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
