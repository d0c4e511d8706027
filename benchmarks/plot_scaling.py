"""Draw scaling by replica count from every stored line: ``docs/scaling.png``.

Two panels from ``benchmarks/results/scaling.jsonl`` (``report_scaling.scaling_series``): training
images/s (ours: the median over the epochs after the first; DDP: over its training, evaluations
left out) and epochs to the line's target, by replica count (DDP: its processes). One line per
stored line for ours swept (``--trainers R``), a star for its defaults run, a square for DDP;
a run that missed its target has no point in the epochs panel, and its label says so. Needs
matplotlib (``pip install ".[plot]"``). Usage: ``python benchmarks/plot_scaling.py [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import plot_data
from report_scaling import scaling_series

OUT = plot_data.ROOT / "docs" / "scaling.png"
MARKERS = {"ours": "-o", "defaults": "*", "ddp": "s"}
NAMES = {"ours": "ours, --trainers R", "defaults": "ours, the defaults", "ddp": "PyTorch DDP"}


def _label(kind: str, line: dict, series: dict) -> str:
    stamp = (
        f"{str(line.get('date', '?'))[:10]}, {line.get('commit', '?')}, "
        f"{line.get('cpus', '?')} CPUs"
    )
    missed = [r for r, e in zip(series["replicas"], series["epochs_to_target"]) if e is None]
    tail = f"; target missed at R = {', '.join(map(str, missed))}" if missed else ""
    return f"{NAMES[kind]} ({stamp}{tail})"


def plot(lines: list[dict], out: Path) -> list[str]:
    """Write every line's series to ``out``; returns the legend's labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [(ln, scaling_series(ln)) for ln in lines]
    drawn = [(ln, s) for ln, s in drawn if s]
    if not drawn:
        raise SystemExit("no scaling line with a sweep, DDP or defaults run: run scaling.py first")
    fig, (ax_rate, ax_epochs) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = []
    for i, (line, series) in enumerate(drawn):
        color = f"C{i % 10}"
        for kind, s in series.items():
            label = _label(kind, line, s)
            style = MARKERS[kind]
            size = 12 if kind == "defaults" else 6
            rate = [(r, v) for r, v in zip(s["replicas"], s["images_per_second"]) if v is not None]
            if rate:
                ax_rate.plot(*zip(*rate), style, color=color, ms=size, label=label)
                labels.append(label)
            eps = [(r, v) for r, v in zip(s["replicas"], s["epochs_to_target"]) if v is not None]
            if eps:
                ax_epochs.plot(*zip(*eps), style, color=color, ms=size)
    targets = sorted({f"{100 * ln.get('target', 0.99):g}%" for ln, _ in drawn})
    ax_rate.set_ylabel("training images/s")
    ax_epochs.set_ylabel(f"epochs to the target ({', '.join(targets)})")
    counts = sorted({r for _, s in drawn for part in s.values() for r in part["replicas"]})
    for ax in (ax_rate, ax_epochs):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(r) for r in counts])
        ax.minorticks_off()
        ax.set_xlabel("replicas (DDP: processes)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_epochs.yaxis.get_major_locator().set_params(integer=True)
    fig.legend(fontsize=7, loc="lower center", ncol=2)
    fig.suptitle(f"Scaling by replica count: {len(drawn)} stored scaling line(s)", fontsize=10)
    plot_data.save_figure(fig, out, rect=(0, 0.03 + 0.035 * ((len(labels) + 1) // 2), 1, 1))
    return labels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    path = plot_data.RESULTS / "scaling.jsonl"
    plot(plot_data.read_lines(path) if path.exists() else [], args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
