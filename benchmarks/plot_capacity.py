"""Draw the parameter server's capacity curve from the newest stored line: ``docs/capacity.png``.

From the newest ``benchmarks/results/capacity.jsonl`` line, against the count of emulated
replicas: the p99 push latency (with the line's bound) and the MB of deltas taken in per
second, for ours (one parameter-server group) and the socket sink (the machine's limit).
Hollow markers are counts past the bound. Needs matplotlib (``pip install ".[plot]"``).
Usage: ``python benchmarks/plot_capacity.py [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import plot_data

OUT = plot_data.ROOT / "docs" / "capacity.png"
STYLE = {"ours": ("tab:blue", "-"), "socket sink": ("tab:grey", "--")}


def plot(line: dict, out: Path) -> list[str]:
    """Write ``line``'s curves to ``out``; returns the curves' labels (left panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    curves = plot_data.capacity_curves(line)
    if not curves:
        raise SystemExit("no capacity line with a curve: run benchmarks/capacity.py first")
    fig, (lat, mb) = plt.subplots(1, 2, figsize=(10, 4.2))
    served = {"ours": line.get("replicas_served"), "socket sink": line.get("sink_replicas_served")}
    ticks: set[int] = set()
    for name, c in curves.items():
        z = 3 if name == "ours" else 2  # ours on top where the curves meet
        colour, ls = STYLE.get(name, ("tab:orange", "-"))
        ticks.update(c["replicas"])
        label = f"{name} (serves {served.get(name)})"
        for ax, key in ((lat, "p99_ms"), (mb, "mb_per_s")):
            pts = [
                (r, v, w)
                for r, v, w in zip(c["replicas"], c[key], c["within"], strict=True)
                if v is not None
            ]
            if not pts:
                continue
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], ls, color=colour, label=label, zorder=z
            )
            for r, v, w in pts:
                ax.plot(r, v, "o", color=colour, mfc=colour if w else "white", zorder=z)
    bound = line.get("p99_bound_ms")
    if bound:
        lat.axhline(bound, color="black", lw=0.8, ls=":", label=f"bound {bound:g} ms")
    for ax in (lat, mb):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.minorticks_off()
        ax.set_xlabel("emulated replicas (hollow: past the bound)")
        ax.grid(alpha=0.3, which="both")
    lat.set_yscale("log")
    lat.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    lat.set_ylabel("p99 push latency (ms)")
    mb.set_ylabel("deltas taken in (MB/s)")
    lat.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "Parameter-server capacity: ours vs a socket sink "
        f"({str(line.get('date', '?'))[:10]}, {line.get('commit', '?')}, "
        f"{line.get('cpus', '?')} CPUs)",
        fontsize=10,
    )
    labels = [ln.get_label() for ln in lat.get_lines() if not ln.get_label().startswith("_")]
    plot_data.save_figure(fig, out)
    return labels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    path = plot_data.RESULTS / "capacity.jsonl"
    lines = plot_data.read_lines(path) if path.exists() else []
    plot(lines[-1] if lines else {}, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
