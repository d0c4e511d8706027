"""The plots' data and files: where the stored lines are, how one is read, each plot's
curves from a line, and how a figure is written. The plots (``plot_*.py``) and the report
(``report.py``, which draws them) both read it; it reads neither.
"""

from __future__ import annotations

import json
from pathlib import Path

import report_helpers
import report_rules as rules

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def read_lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def save_figure(fig, out: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    """Lay out ``fig`` within ``rect`` (of the figure: room left below for a figure legend),
    write it to ``out`` (its folder made) and close it: every plot's end."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


TTA_RUNS = (
    ("ours", "ours: adam-dask train, embedded cluster"),
    ("engine", "the engine alone"),
    ("torch", "PyTorch"),
)


def target(line: dict) -> str:
    return f"{100 * line.get('target', 0.99):g}%"


def tta_curves(line: dict) -> dict[str, list[float]]:
    """label -> test accuracy after each epoch, for each run the time_to_accuracy line holds a
    curve of (ours, the engine alone, PyTorch), the label saying its seconds to the target."""
    out = {}
    for key, name in TTA_RUNS:
        curve = line.get(f"{key}_curve")
        if not curve:
            continue
        secs = rules.get(line, f"{key}_seconds_to_target")
        reached = (
            f"{target(line)} in {rules.num(secs)} s" if rules.is_num(secs) else "target not reached"
        )
        out[f"{name} ({reached})"] = list(curve)
    return out


def capacity_curves(line: dict) -> dict[str, dict[str, list]]:
    """``{"ours": ..., "socket sink": ...}`` from a capacity line's ``curve`` and
    ``sink_curve``, each ``{"replicas": [...], "p99_ms": [...], "mb_per_s": [...],
    "within": [...]}`` (``within``: the count met the line's bound); empty without a curve."""
    out = {}
    for name, key in (("ours", "curve"), ("socket sink", "sink_curve")):
        points = [p for p in line.get(key) or [] if isinstance(p, dict) and "replicas" in p]
        if not points:
            continue
        p99 = report_helpers.p99_key(points[0])
        out[name] = {
            "replicas": [p["replicas"] for p in points],
            "p99_ms": [p.get(p99) if p99 else None for p in points],
            "mb_per_s": [p.get("mb_per_s") for p in points],
            "within": [bool(p.get("within", True)) for p in points],
        }
    return out if "ours" in out else {}
