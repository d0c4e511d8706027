"""benchmarks/report.py: the README's figures come from the stored lines, and Table 1 is shown
seed by seed for one recipe."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench(name: str):
    """benchmarks/NAME.py as a module, with benchmarks/ on sys.path while it loads (as when it
    runs as a script: plot_table1 imports report)."""
    path = str(ROOT / "benchmarks")
    sys.path.insert(0, path)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(path)
    return mod


def _report():
    return _bench("report")


def _line(seed, a, s, *, epochs=30, commit="c", best=0.999):
    def run(sd, acc):
        return {"seed": sd, "accuracy": acc, "best_accuracy": best}

    line = {"date": "2026-11-24T00:00:00Z", "commit": commit, "epochs": epochs, "lr": 0.05}
    if isinstance(seed, list):  # a --seeds line
        line.update(
            seed=seed,
            **{"async": [run(x, y) for x, y in zip(seed, a)]},
            sync=[run(x, y) for x, y in zip(seed, s)],
        )
    else:
        line.update(seed=seed, **{"async": run(seed, a)}, sync=run(seed, s))
    return line


def test_table1_shows_the_newest_pair_of_each_seed_of_the_newest_recipe():
    report = _report()
    lines = [
        _line(0, 0.9950, 0.9944, commit="old"),  # replaced by the newer seed-0 pair below
        _line(5, 0.9900, 0.9800, epochs=12),  # another recipe: left out
        _line([0, 1], [0.9936, 0.9948], [0.9941, 0.9949], commit="new"),
        {"date": "x", "commit": "one-mode", "epochs": 30, "async": {"seed": 2}},  # no sync
        _line(2, 0.9960, 0.9940, commit="last"),
    ]
    text = report.table1_by_seed(lines)
    rows = [
        r for r in text.splitlines() if r.startswith("| ") and not r.startswith(("| seed", "| ---"))
    ]
    assert [r.split(" | ")[0] for r in rows] == ["| 0", "| 1", "| 2", "| mean of 3"]
    assert "new | 99.36 (99.90) | 99.41 (99.90) | -0.05 |" in rows[0]
    assert "old" not in text and "| 5 |" not in text
    assert rows[3].endswith("| 99.48 | 99.43 | +0.05 |")  # (-0.05 - 0.01 + 0.20) / 3


def test_table1_is_shown_without_unnamed_regularisers_too():
    report = _report()
    smoothed = _line([0, 1], [0.9970, 0.9966], [0.9950, 0.9952], commit="ls")
    smoothed["label_smoothing"] = 0.1
    lines = [_line([0, 1], [0.9957, 0.9967], [0.9942, 0.9944], commit="plain"), smoothed]
    text = report.table1_block(lines)
    plain, _, rest = text.partition("The newest recipe, with label_smoothing 0.1:")
    assert rest, text
    assert "plain" in plain and "ls" not in plain and "| mean of 2 | | 99.62 | 99.43 |" in plain
    assert "ls" in rest and "plain" not in rest and "| mean of 2 | | 99.68 | 99.51 |" in rest
    # the newest recipe without a regulariser: one table, as before
    assert report.table1_block(lines[:1]) == report.table1_by_seed(lines[:1])
    # a line from before label_smoothing was recorded is the same recipe as one with 0
    zero = _line([2], [0.9950], [0.9940], commit="zero")
    zero["label_smoothing"] = 0.0
    assert "plain" in report.table1_block([lines[0], zero])


def test_the_curves_plot_draws_each_shown_recipe(tmp_path):
    mod = _bench("plot_table1")
    a, b = _line([0, 1], [0.9957, 0.9967], [0.9942, 0.9944]), _line([0], [0.997], [0.995])
    b["label_smoothing"] = 0.1
    for ln, base in ((a, 0.990), (b, 0.992)):
        for mode in ("async", "sync"):
            for i, run in enumerate(ln[mode]):
                run["curve"] = [base + 0.001 * e + 0.0001 * i for e in range(5 - i)]
    assert mod.mean_curve(a["async"]) == pytest.approx([0.99005, 0.99105, 0.99205, 0.99305])
    labels = mod.plot([a, b], tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels[:4] == [
        "async, no unnamed regulariser (mean of 2 seeds)",
        "sync, no unnamed regulariser (mean of 2 seeds)",
        "async, label_smoothing 0.1 (mean of 1 seed)",
        "sync, label_smoothing 0.1 (mean of 1 seed)",
    ]
    with pytest.raises(SystemExit, match="no table1 line"):
        mod.plot([], tmp_path / "none.png")


def test_the_readme_shows_what_the_stored_lines_say():
    report = _report()
    readme = (ROOT / "README.md").read_text()
    assert report.render(readme) == readme, "run python benchmarks/report.py"
