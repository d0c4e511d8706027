"""Headless Chromium (Debian's ``chromium``) and an HTML table reader for the dashboard tests."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser

import pytest

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


@pytest.fixture(scope="session")
def chromium(tmp_path_factory):
    """``run(url, screenshot=PNG path or None, dump_dom=False, size=(w, h))``: loads ``url`` in
    a fresh headless Chromium profile; returns its stdout (the DOM with ``dump_dom``)."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail(
            "the dashboard tests need Debian's chromium: run the suite with `bash tools/test` "
            "(it installs it), or apt-get install -y chromium"
        )

    def run(url: str, *, screenshot=None, dump_dom: bool = False, size=(1400, 1000)) -> str:
        profile = tmp_path_factory.mktemp("chromium-profile")
        args = [
            exe,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
        ]
        if screenshot is not None:
            args.append(f"--screenshot={screenshot}")
        if dump_dom:
            args.append("--dump-dom")
        proc = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "ERR_" not in proc.stderr, proc.stderr[-3000:]  # a failed page load
        return proc.stdout

    return run


class _Tables(HTMLParser):
    """Every table of a page, keyed by its first CSS class: a list of rows, each a list of
    (cell class, cell text)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str]]]] = {}
        self._table: list | None = None
        self._row: list | None = None
        self._cell: list | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            name = ((a.get("class") or "").split() or [""])[0]
            self._table = self.tables.setdefault(name, [])
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = [a.get("class") or "", ""]

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[1] += data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append((self._cell[0], self._cell[1].strip()))
            self._cell = None
        elif tag == "table":
            self._table = None


@pytest.fixture(scope="session")
def html_tables():
    """``tables(html) -> {first class: rows}`` (rows of (cell class, text))."""

    def tables(html: str) -> dict[str, list[list[tuple[str, str]]]]:
        p = _Tables()
        p.feed(html)
        return p.tables

    return tables
