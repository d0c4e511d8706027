"""One source for every default: adam.yaml, read through adam_dask.config where objects are built.

These tests read the package's own source: every key in adam.yaml must be read somewhere by its
full name, and no call in the package may carry a literal fallback for a setting.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dask.config
import pytest
import yaml

import adam_dask
from adam_dask import config

PACKAGE = Path(adam_dask.__file__).parent


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.extend(_leaves(v, key + "."))
        else:
            out.append(key)
    return out


def _yaml_keys() -> list[str]:
    with open(PACKAGE / "adam.yaml") as f:
        return _leaves(yaml.safe_load(f)["adam"])


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in PACKAGE.rglob("*.py")}


def _string_constants() -> set[str]:
    found: set[str] = set()
    for path, text in _sources().items():
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
            elif isinstance(node, ast.JoinedStr) and node.values:
                head = node.values[0]
                # f"augment.{name}": every key of the section is read by that one call
                if isinstance(head, ast.Constant) and str(head.value).endswith("."):
                    found.add(str(head.value) + "*")
    return found


@pytest.mark.parametrize("key", _yaml_keys())
def test_every_key_in_adam_yaml_is_read_by_the_code(key):
    strings = _string_constants()
    section = key.rpartition(".")[0]
    read = {key, f"adam.{key}", f"{section}.*", f"adam.{section}.*"}
    assert read & strings, f"adam.{key} is in adam.yaml but no module reads it by name"


def _literal_fallbacks() -> list[str]:
    """Calls ``config.get("key", <literal>)`` / ``dask.config.get("adam.key", default=<literal>)``
    and ``<settings dict>.get("key", <number>)`` inside the package."""
    bad = []
    for path, text in _sources().items():
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "get" or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            owner = ast.unparse(node.func.value)
            fallback = node.args[1] if len(node.args) > 1 else None
            for kw in node.keywords:
                if kw.arg == "default":
                    fallback = kw.value
            if fallback is None:
                continue
            literal = isinstance(fallback, ast.Constant) and fallback.value is not None
            numeric = literal and isinstance(fallback.value, int | float)
            is_config = owner.endswith("config")
            is_settings = owner in {"self.cfg", "cfg", "self.config", "settings", "node_config"}
            if (is_config and literal) or (is_settings and numeric):
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                bad.append(f"{where}: {ast.unparse(node)}")
    return bad


def test_no_default_is_written_in_code():
    assert _literal_fallbacks() == []


def test_a_keyword_wins_over_the_setting_and_the_setting_over_the_file():
    assert config.get("ps.shard-bytes") == dask.config.get("adam.ps.shard-bytes")
    assert config.get("ps.shard-bytes", 4096) == 4096
    with dask.config.set({"adam.ps.shard-bytes": 12345}):
        assert config.get("ps.shard-bytes") == 12345
        assert config.get("ps.shard-bytes", 4096) == 4096


def test_an_environment_variable_sets_a_default(monkeypatch):
    monkeypatch.setenv("DASK_ADAM__TRAIN__PUSH_EVERY", "77")
    dask.config.refresh()
    try:
        assert config.get("train.push-every") == 77
    finally:
        monkeypatch.delenv("DASK_ADAM__TRAIN__PUSH_EVERY")
        dask.config.refresh()
    assert config.get("train.push-every") != 77
