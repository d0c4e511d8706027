"""tools/structure.py's package-cycle check, on made-up trees: it fails on two packages that
import each other, and passes the same tree once one edge goes, or when the only way back is a
package's ``__init__`` re-exporting its own children."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "structure.py"


@pytest.fixture
def structure(tmp_path):
    """The tool, copied away from the house's list of known breaches."""
    copy = tmp_path / "tool" / "structure.py"
    copy.parent.mkdir()
    copy.write_text(TOOL.read_text())
    spec = importlib.util.spec_from_file_location("structure_under_test", copy)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


BASE = {
    "pkg/__init__.py": "",
    "pkg/a/__init__.py": "",
    "pkg/b/__init__.py": "",
    "pkg/a/x.py": "from ..b.y import Y\n",
    "pkg/b/y.py": "Y = 1\n",
    "pkg/b/z.py": "def f():\n    from pkg.a import w\n",
    "pkg/a/w.py": "W = 2\n",
}


def test_two_packages_importing_each_other_fail(structure, tmp_path, monkeypatch, capsys):
    # no module cycle (x -> y, z -> w), but package a imports b and b imports a
    tree(tmp_path, BASE)
    monkeypatch.chdir(tmp_path)
    assert structure.main(["structure.py", "pkg"]) == 1
    out = capsys.readouterr().out
    assert "NEW  package import cycle: pkg.a <-> pkg.b" in out
    assert "via pkg.a.x -> pkg.b.y" in out and "via pkg.b.z -> pkg.a.w" in out
    assert "import cycle: pkg.a.x" not in out


def test_one_way_between_packages_passes(structure, tmp_path, monkeypatch, capsys):
    tree(tmp_path, {**BASE, "pkg/b/z.py": "Z = 3\n"})
    monkeypatch.chdir(tmp_path)
    assert structure.main(["structure.py", "pkg"]) == 0
    assert "cycle" not in capsys.readouterr().out


def test_an_init_re_exporting_its_children_is_no_cycle(structure, tmp_path, monkeypatch):
    # pkg.a.w imports pkg's __init__, which re-exports pkg.a.x: the only way from pkg down
    # to pkg.a is its __init__'s, into its own children
    files = {**BASE, "pkg/b/z.py": "Z = 3\n", "pkg/__init__.py": "N = 1\nfrom .a.x import Y\n"}
    files["pkg/a/w.py"] = "from .. import N\n"
    tree(tmp_path, files)
    monkeypatch.chdir(tmp_path)
    assert structure.main(["structure.py", "pkg"]) == 0


def test_a_parent_module_and_its_subpackage_importing_each_other_fail(
    structure, tmp_path, monkeypatch, capsys
):
    # a module of pkg imports pkg.a, and pkg.a imports a module of pkg back
    files = {**BASE, "pkg/b/z.py": "Z = 3\n", "pkg/top.py": "from .a import w\n"}
    files["pkg/a/w.py"] = "from ..top import *\n"
    tree(tmp_path, files)
    monkeypatch.chdir(tmp_path)
    assert structure.main(["structure.py", "pkg"]) == 1
    assert "package import cycle: pkg <-> pkg.a" in capsys.readouterr().out
