"""Draw Table 1's learning curves from the stored lines: ``docs/table1-curves.png``.

For each recipe docs/table1.md's Table 1 block shows
(:func:`report_table1.plain_and_newest`, then each other server optimizer's,
:func:`report_table1.other_optimizers`), the test accuracy after every epoch, averaged over the
seeds the block lists, asynchronous (solid) and synchronous (dashed), beside the paper's two
figures. Needs matplotlib (``pip install ".[plot]"``). Usage: ``python benchmarks/plot_table1.py [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import plot_data
from report_table1 import other_optimizers, plain_and_newest, regularisers_used, table1_pairs

OUT = plot_data.ROOT / "docs" / "table1-curves.png"
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def mean_curve(runs: list[dict]) -> list[float]:
    """The per-epoch mean of the runs' ``curve`` lists, as long as the shortest."""
    curves = [r["curve"] for r in runs if r.get("curve")]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [sum(c[i] for c in curves) / len(curves) for i in range(n)]


def plot(lines: list[dict], out: Path) -> list[str]:
    """Write the curves of ``lines`` (table1.jsonl's) to ``out``; returns the curves' labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = plain_and_newest(lines)
    if not shown:
        raise SystemExit("no table1 line with both modes: run benchmarks/table1.py first")
    named = [(regularisers_used(ln) or "no unnamed regulariser", ln) for ln in shown]
    named += [(f"server {opt}", ln) for opt, ln in other_optimizers(lines).items()]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for colour, (name, like) in zip(COLOURS, named, strict=False):
        pairs = table1_pairs(lines, like)
        for mode, style, idx in (("async", "-", 1), ("sync", "--", 2)):
            curve = mean_curve([p[idx] for p in pairs.values()])
            if curve:
                ax.plot(
                    range(1, len(curve) + 1),
                    [100 * v for v in curve],
                    style,
                    color=colour,
                    label=f"{mode}, {name} (mean of {len(pairs)} seed{'s' * (len(pairs) > 1)})",
                )
    ax.axhline(99.63, color="black", lw=0.8, ls=":", label="paper async 99.63")
    ax.axhline(99.39, color="grey", lw=0.8, ls=":", label="paper sync 99.39")
    ax.set_ylim(99.0, 99.8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("MNIST test accuracy (%)")
    ax.set_title("Table 1: the paper's network, asynchronous vs synchronous training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    labels = [str(ln.get_label()) for ln in ax.get_lines()]
    plot_data.save_figure(fig, out)
    return labels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    plot(plot_data.read_lines(plot_data.RESULTS / "table1.jsonl"), args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
