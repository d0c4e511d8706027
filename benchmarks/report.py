"""Write the README's table of measured figures from the stored benchmark lines.

Each benchmark appends one JSON line per run to ``benchmarks/results/NAME.jsonl`` (see
``_common.record``). This script takes the newest line of each file and rewrites the block
between ``<!-- figures:start -->`` and ``<!-- figures:end -->`` in README.md, so no figure in the
README is typed by hand. ``--check`` exits 1 when the README is not up to date.

Table 1 gets a block of its own (``<!-- table1:start -->`` ... ``<!-- table1:end -->``): one run
of each mode is noise (two runs of one recipe differ by ~0.07 points), so the block shows, for
the recipe of the newest table1 line, the newest async/sync pair of every seed and their mean.
When that recipe uses a regulariser the paper does not name (dropout, label smoothing), the
block shows the newest recipe without any first, so Table 1 is always reported without them.

Without ``--check`` it also redraws ``docs/table1-curves.png`` (``plot_table1.py``) when
matplotlib is installed.

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
T1_START, T1_END = "<!-- table1:start -->", "<!-- table1:end -->"
# what makes two table1 lines the same experiment (the seed aside)
RECIPE = (
    "epochs",
    "lr",
    "lr_schedule",
    "lr_floor",
    "lr_warmup",
    "lr_replicas",
    "dropout",
    "label_smoothing",
    "batch_norm",
    "push_every",
    "trainers",
    "trainer_threads",
    "overrides",
    "augment",
)
# the value a recipe key had before lines recorded it
RECIPE_DEFAULTS = {"label_smoothing": 0.0, "batch_norm": False}
# recipe keys that are regularisers the paper does not name (0 or absent: off)
REGULARISERS = ("dropout", "label_smoothing", "batch_norm")
STAMP = ("benchmark", "date", "commit", "cpus", "notes", "load")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def newest(path: Path) -> dict | None:
    lines = read_lines(path)
    return lines[-1] if lines else None


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


def _recipe(line: dict) -> str:
    return json.dumps({k: line.get(k, RECIPE_DEFAULTS.get(k)) for k in RECIPE}, sort_keys=True)


def _runs(line: dict, mode: str) -> list[dict]:
    """A line's runs of ``mode``: one dict (one seed) or a list of them (``--seeds``)."""
    runs = line[mode]
    return runs if isinstance(runs, list) else [runs]


def _pct(v: float) -> str:
    return f"{100 * v:.2f}"


def _pairs(lines: list[dict]) -> list[dict]:
    return [ln for ln in lines if "async" in ln and "sync" in ln]


def regularisers_used(line: dict) -> str:
    """The regularisers the paper does not name that ``line``'s recipe uses, e.g.
    ``"label_smoothing 0.1, batch_norm"`` (empty: none)."""
    used = [k if line[k] is True else f"{k} {_fmt(line[k])}" for k in REGULARISERS if line.get(k)]
    return ", ".join(used)


def plain_and_newest(lines: list[dict]) -> list[dict]:
    """The lines whose recipes Table 1 is shown for: the newest with both modes, preceded by
    the newest without a regulariser the paper does not name when that is another recipe."""
    pairs = _pairs(lines)
    if not pairs:
        return []
    plain = [ln for ln in pairs if not any(ln.get(k) for k in REGULARISERS)]
    if plain and _recipe(plain[-1]) != _recipe(pairs[-1]):
        return [plain[-1], pairs[-1]]
    return [pairs[-1]]


def table1_pairs(lines: list[dict], like: dict) -> dict[int, tuple[dict, dict, dict]]:
    """seed -> (line, async run, sync run): the newest pair of every seed with ``like``'s
    recipe."""
    recipe = _recipe(like)
    by_seed: dict[int, tuple[dict, dict, dict]] = {}
    for ln in _pairs(lines):
        if _recipe(ln) != recipe:
            continue
        for a, s in zip(_runs(ln, "async"), _runs(ln, "sync"), strict=True):
            by_seed[int(a["seed"])] = (ln, a, s)
    return by_seed


def table1_by_seed(lines: list[dict], like: dict | None = None) -> str:
    """For the recipe of ``like`` (default: the newest line with both modes): the newest pair
    of every seed, and the means over those seeds."""
    pairs = _pairs(lines)
    if not pairs:
        return "No table1 line with both modes yet."
    like = pairs[-1] if like is None else like
    by_seed = table1_pairs(lines, like)
    rows = [
        "| seed | run (date, commit) | async final (best) | sync final (best) | async - sync |",
        "| --- | --- | --- | --- | --- |",
    ]
    diffs, finals = [], {"async": [], "sync": []}
    for seed in sorted(by_seed):
        ln, a, s = by_seed[seed]
        diff = a["accuracy"] - s["accuracy"]
        diffs.append(diff)
        finals["async"].append(a["accuracy"])
        finals["sync"].append(s["accuracy"])
        rows.append(
            f"| {seed} | {ln.get('date', '?')[:10]}, {ln.get('commit', '?')} | "
            f"{_pct(a['accuracy'])} ({_pct(a['best_accuracy'])}) | "
            f"{_pct(s['accuracy'])} ({_pct(s['best_accuracy'])}) | {100 * diff:+.2f} |"
        )
    n = len(diffs)
    rows.append(
        f"| mean of {n} | | {_pct(sum(finals['async']) / n)} | {_pct(sum(finals['sync']) / n)} "
        f"| {100 * sum(diffs) / n:+.2f} |"
    )
    last = like
    shown = {k: last[k] for k in RECIPE if k in last and k not in ("overrides", "augment")}
    recipe_text = ", ".join(f"{k} {_fmt(v)}" for k, v in shown.items())
    return "\n".join(
        [
            f"Recipe: {recipe_text}; overrides {_fmt(last.get('overrides') or {}) or 'none'}. "
            f"The paper: async {_pct(last.get('paper_async', 0.9963))}, sync "
            f"{_pct(last.get('paper_sync', 0.9939))}.",
            "",
            *rows,
        ]
    )


def table1_block(lines: list[dict]) -> str:
    """:func:`table1_by_seed` of the newest recipe; when it uses a regulariser the paper does
    not name, that of the newest recipe without one first."""
    shown = plain_and_newest(lines)
    if len(shown) < 2:
        return table1_by_seed(lines)
    plain, newest = shown
    used = regularisers_used(newest)
    return "\n".join(
        [
            "The paper's network and loss, no regulariser it does not name:",
            "",
            table1_by_seed(lines, plain),
            "",
            f"The newest recipe, with {used}:",
            "",
            table1_by_seed(lines, newest),
        ]
    )


def _replace(readme: str, start: str, end: str, body: str) -> str:
    if start not in readme or end not in readme:
        raise SystemExit(f"README.md has no {start} ... {end} block")
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def render(readme: str) -> str:
    out = _replace(readme, START, END, table())
    t1 = RESULTS / "table1.jsonl"
    body = table1_block(read_lines(t1) if t1.exists() else [])
    return _replace(out, T1_START, T1_END, body)


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
    try:  # the Table 1 curves, drawn from the same lines, when matplotlib is installed
        import plot_table1
    except ImportError:
        return 0
    t1 = RESULTS / "table1.jsonl"
    lines = read_lines(t1) if t1.exists() else []
    if _pairs(lines):
        plot_table1.plot(lines, plot_table1.OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
