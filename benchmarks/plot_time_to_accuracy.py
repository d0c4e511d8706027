"""Draw time to accuracy from the newest stored line: ``docs/time-to-accuracy.png``.

The test accuracy after every epoch of the three runs of the newest
``benchmarks/results/time_to_accuracy.jsonl`` line (ours: ``adam-dask train`` on the embedded
cluster; the same engine alone; the same network in PyTorch), with the target. The lines store
no time per epoch, so the x axis is epochs; each curve's label gives its seconds to the target.
Needs matplotlib (``pip install ".[plot]"``). Usage:
``python benchmarks/plot_time_to_accuracy.py [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import plot_data

OUT = plot_data.ROOT / "docs" / "time-to-accuracy.png"
STYLES = ("-o", "--s", ":^")


def plot(line: dict, out: Path) -> list[str]:
    """Write ``line``'s curves to ``out``; returns the curves' labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = plot_data.tta_curves(line)
    if not curves:
        raise SystemExit("no time_to_accuracy line with curves: run time_to_accuracy.py first")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for style, (label, curve) in zip(STYLES, curves.items(), strict=False):
        ax.plot(range(1, len(curve) + 1), [100 * v for v in curve], style, label=label)
    target = 100 * line.get("target", 0.99)
    ax.axhline(target, color="black", lw=0.8, ls=":", label=f"target {target:g}%")
    ax.set_xlabel("epoch (the line stores no time per epoch)")
    ax.set_ylabel("MNIST test accuracy (%)")
    ax.set_xticks(range(1, max(len(c) for c in curves.values()) + 1))
    ax.set_title(
        f"Time to {target:g}%: test accuracy after each epoch "
        f"({str(line.get('date', '?'))[:10]}, {line.get('commit', '?')}, "
        f"{line.get('cpus', '?')} CPUs)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    labels = [str(ln.get_label()) for ln in ax.get_lines()]
    plot_data.save_figure(fig, out)
    return labels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    lines = plot_data.read_lines(plot_data.RESULTS / "time_to_accuracy.jsonl")
    plot(lines[-1] if lines else {}, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
