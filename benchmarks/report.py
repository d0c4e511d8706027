"""Write the README's table of measured figures from the stored benchmark lines.

Each benchmark appends one JSON line per run to ``benchmarks/results/NAME.jsonl`` (see
``_common.record``). This script takes the newest line of each file and rewrites the block
between ``<!-- figures:start -->`` and ``<!-- figures:end -->`` in README.md, so no figure in the
README is typed by hand. ``--check`` exits 1 when the README is not up to date.

Usage: ``python benchmarks/report.py [--check]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- figures:start -->", "<!-- figures:end -->"
STAMP = ("benchmark", "date", "commit", "cpus", "notes", "load")


def newest(path: Path) -> dict | None:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1]) if lines else None


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items() if not isinstance(x, dict | list))
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v[:8]) + (", ..." if len(v) > 8 else "") + "]"
    return str(v)


def figures(line: dict) -> str:
    """The line's measured fields (scalars and small dicts), in the order it wrote them."""
    shown = [
        f"{k} {_fmt(v)}"
        for k, v in line.items()
        if k not in STAMP and not (isinstance(v, list) and len(v) > 12)
    ]
    return "; ".join(shown)


def table() -> str:
    rows = [
        "| benchmark | newest run (date, commit, CPUs) | figures |",
        "| --- | --- | --- |",
    ]
    for path in sorted(RESULTS.glob("*.jsonl")):
        line = newest(path)
        if line is None:
            continue
        when = f"{line.get('date', '?')[:10]}, {line.get('commit', '?')}, {line.get('cpus', '?')}"
        rows.append(f"| `{path.stem}` | {when} | {figures(line)} |")
    return "\n".join(rows)


def render(readme: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = p.parse_args(argv)
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(
                "README.md figures are out of date: run python benchmarks/report.py",
                file=sys.stderr,
            )
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
