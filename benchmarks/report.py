"""Write the generated figures of the README and docs/ from the stored benchmark lines.

Each benchmark appends one JSON line per run to ``benchmarks/results/NAME.jsonl`` (see
``_common.record``). This script rewrites each page's generated blocks (``PAGES``: which page
holds which block) and ``docs/results.md`` from those lines, so no figure in them is typed by
hand; ``--check`` exits 1 when any of them is not up to date (and so does the test suite:
``tests/test_report.py``). A block is delimited by ``<!-- NAME:start -->`` ...
``<!-- NAME:end -->``.

* ``figures``, in README.md: a table of headline figures, one row per claim
  (``report_claims.CLAIMS``: each a record of its benchmark, the fields it reads, the peer
  measured in the same run and the words; ``report_record`` applies the same rules to all),
  each from the newest line of its benchmark that measures it: ours beside the peer, named, and
  their ratio in words ("0.84x the time PyTorch takes"), with the line's date, commit, CPU count
  and load. Benchmarks without a line have no row. Then the plots whose data is stored.
* ``sizing``, in docs/setup.md: the sizing sentence (``report_table1``).
* ``table1``, in docs/table1.md: Table 1 seed by seed (``report_table1``).
* ``server-optimizer``, in docs/benchmarks.md: every server-optimizer run and the communication
  goal's sentence (``report_optimizer``); ``scaling``, there too: every scaling line, its sweep
  and the plot (``report_scaling``).
* ``docs/results.md``, the whole page: every stored line of every benchmark, oldest first, so
  the newest is never shown without the others: for a benchmark the table reads, what each line
  says about each of its claims; for the others, what the line records.

Without ``--check`` it also redraws, when matplotlib is installed and their lines are stored,
``docs/table1-curves.png`` (``plot_table1.py``), ``docs/time-to-accuracy.png``
(``plot_time_to_accuracy.py``), ``docs/capacity.png`` (``plot_capacity.py``) and
``docs/scaling.png`` (``plot_scaling.py``).

Usage: ``python benchmarks/report.py [--check]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import report_rules as rules
from plot_data import RESULTS, ROOT, capacity_curves, read_lines, target, tta_curves
from report_claims import CLAIMS
from report_optimizer import optimizer_block
from report_record import figure
from report_scaling import scaling_block, scaling_series
from report_table1 import (
    other_optimizers,
    plain_and_newest,
    regularisers_used,
    sizing_sentence,
    table1_block,
    table1_by_seed,
    table1_pairs,
)

__all__ = [
    "other_optimizers",
    "plain_and_newest",
    "regularisers_used",
    "sizing_sentence",
    "table1_block",
    "table1_by_seed",
    "table1_pairs",
]

README = ROOT / "README.md"
DOCS = ROOT / "docs"
SETUP_MD, TABLE1_MD, BENCHMARKS_MD = DOCS / "setup.md", DOCS / "table1.md", DOCS / "benchmarks.md"
RESULTS_MD = DOCS / "results.md"
# each page with generated blocks, and the blocks it holds (docs/results.md is generated whole)
PAGES: dict[Path, tuple[str, ...]] = {
    README: ("figures",),
    SETUP_MD: ("sizing",),
    TABLE1_MD: ("table1",),
    BENCHMARKS_MD: ("server-optimizer", "scaling"),
}
RESULTS_LINK = "docs/results.md"  # from the README, where the figures block is
TTA_PNG_LINK, CAPACITY_PNG_LINK = "docs/time-to-accuracy.png", "docs/capacity.png"
STAMP = ("date", "commit", "cpus", "benchmark", *rules.LOAD_KEYS)


def load_results(folder: Path = RESULTS) -> dict[str, list[dict]]:
    """Every stored line, by benchmark (the file's stem), oldest first."""
    return {p.stem: read_lines(p) for p in sorted(folder.glob("*.jsonl"))}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


# --- the headline table: one row per claim, ours beside the peer measured in the same run ---


def headline(results: dict[str, list[dict]]) -> str:
    """The table of headline figures: one row per claim its benchmark's newest line measures
    (a benchmark without a line has no row), then which benchmarks have none and which stored
    files the table does not summarise."""
    rows = [
        "| claim | ours | peer | in words | newest run (date, commit, CPUs) | stored runs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for claim in CLAIMS:
        lines = results.get(claim.bench) or []
        line = claim.newest(lines)
        if line is None:
            continue
        fig = figure(claim, line)
        assert fig is not None
        stored = f"{len(lines)} in `{claim.bench}`"
        rows.append(_row([fig.what, fig.ours, fig.peer, fig.words, rules.run_stamp(line), stored]))
    out = ["\n".join(rows)]
    missing = sorted({c.bench for c in CLAIMS} - set(shown_benchmarks(results)))
    if missing:
        out.append(
            "No stored line measures these yet: " + ", ".join(f"`{b}`" for b in missing) + "."
        )
    others = sorted(set(results) - {c.bench for c in CLAIMS})
    if others:
        out.append(
            f"Stored but not summarised here (every run listed in [{RESULTS_LINK}]"
            f"({RESULTS_LINK})): "
            + ", ".join(f"`{b}` ({len(results[b])} lines)" for b in others)
            + "."
        )
    return "\n\n".join(out)


def shown_benchmarks(results: dict[str, list[dict]]) -> list[str]:
    """The benchmarks with a row in the headline table, in the table's order."""
    out: list[str] = []
    for claim in CLAIMS:
        lines = results.get(claim.bench) or []
        if lines and claim.bench not in out and claim.newest(lines) is not None:
            out.append(claim.bench)
    return out


def _details(bench: str, n: int, rows: list[str]) -> str:
    summary = f"<code>{bench}</code>: all {n} stored run{'s' * (n != 1)}"
    return "\n".join([f"<details><summary>{summary}</summary>", "", *rows, "", "</details>"])


def every_run(bench: str, lines: list[dict]) -> str:
    """A collapsible list of every stored line of ``bench``: its stamp and what it says about
    each of the benchmark's claims."""
    claims = [c for c in CLAIMS if c.bench == bench]
    rows = [
        "| run (date, commit, CPUs) | " + " | ".join(c.name for c in claims) + " |",
        "| --- |" + " --- |" * len(claims),
    ]
    for ln in lines:
        figs = [figure(c, ln) for c in claims]
        # a busy machine's line: its timings are listed, not claimed
        stamp = rules.run_stamp(ln) + (
            ", no claim of speed" if rules.busy(ln) and any(f and f.timed for f in figs) else ""
        )
        rows.append(_row([stamp, *(f.brief if f and f.brief else "—" for f in figs)]))
    return _details(bench, len(lines), rows)


def recorded(line: dict) -> str:
    """What a line of a benchmark no claim reads records, in a few words: its scalar fields."""
    shown = [
        f"{k} {rules.short(v)}"
        for k, v in line.items()
        if k not in STAMP and not isinstance(v, dict | list) and len(str(v)) <= 40
    ]
    return ", ".join(shown[:12]) + (", ..." if len(shown) > 12 else "")


def other_runs(bench: str, lines: list[dict]) -> str:
    """A collapsible list of every stored line of a benchmark no claim reads."""
    rows = ["| run (date, commit, CPUs) | what the line records |", "| --- | --- |"]
    rows += [_row([rules.run_stamp(ln), recorded(ln)]) for ln in lines]
    return _details(bench, len(lines), rows)


def results_page(results: dict[str, list[dict]]) -> str:
    """docs/results.md: every stored line of every benchmark."""
    claimed = [b for b in dict.fromkeys(c.bench for c in CLAIMS) if results.get(b)]
    others = sorted(set(results) - set(claimed))
    n = sum(len(v) for v in results.values())
    parts = [
        "# Every stored benchmark run",
        "<!-- generated by python benchmarks/report.py from benchmarks/results/*.jsonl: do not "
        "edit (report.py --check and tests/test_report.py fail when this file is stale) -->",
        f"All {n} stored lines of the {len(results)} files in `benchmarks/results/`, oldest first "
        "in each. The README's [Measured](../README.md#measured) table shows the newest line of "
        "each claim; here is every line, so the newest is never read without the others. Each "
        "run gives its date, commit, CPU count and the highest load average it recorded; a line "
        f"recorded at a load above {rules.BUSY_PER_CPU:g} per CPU makes no claim of speed and "
        "says so.",
    ]
    if claimed:
        parts.append(
            "## The benchmarks of the headline table\n\n"
            "Each cell: what the line says about one claim (ours vs the peer and their ratio); — "
            "where the line does not measure it."
        )
        parts.extend(every_run(b, results[b]) for b in claimed)
    if others:
        parts.append(
            "## Stored, not in the headline table\n\nEach cell: the line's scalar fields "
            "(the first 12)."
        )
        parts.extend(other_runs(b, results[b]) for b in others)
    return "\n\n".join(parts) + "\n"


# --- the generated blocks: the README's figures; the sizing sentence, Table 1, the server
# optimizer and scaling in docs/ ---


def figures_block(results: dict[str, list[dict]]) -> str:
    """The README's Measured block: the headline table and the plots whose data is stored
    (every stored run is in docs/results.md)."""
    parts = [
        "One row per claim, from the newest stored line of its benchmark, beside the peer "
        "measured in the same run; *stored runs* counts the benchmark's lines, every one "
        f"of them listed in [{RESULTS_LINK}]({RESULTS_LINK}). Wall-clock figures come from a "
        "shared machine: each row gives the CPU count and the highest load average its line "
        "recorded (or that it recorded none). A line recorded at a load above "
        f"{rules.BUSY_PER_CPU:g} per CPU makes no claim of speed; two figures whose repeated "
        "runs overlap, or single figures less than "
        f"{100 * rules.NOISE:g}% apart, are within noise and said to be. The words of each row "
        "(which faults, how many, which run a figure comes from) are read from its line.",
        headline(results),
    ]
    tta = results.get("time_to_accuracy") or []
    if tta and tta_curves(tta[-1]):
        ln = tta[-1]
        parts.append(
            f"![Test accuracy per epoch: ours, the engine alone, PyTorch]({TTA_PNG_LINK})\n\n"
            f"Test accuracy after each epoch in the newest `time_to_accuracy` run "
            f"({rules.run_stamp(ln)}), plotted per epoch: the line stores no time per epoch (the "
            f"seconds to {target(ln)} are in the legend and the table). "
            "`python benchmarks/plot_time_to_accuracy.py` draws it."
        )
    cap = results.get("capacity") or []
    if cap and capacity_curves(cap[-1]):
        ln = cap[-1]
        parts.append(
            f"![Parameter-server capacity: p99 push latency and MB/s by replicas]"
            f"({CAPACITY_PNG_LINK})\n\n"
            f"The newest `capacity` run ({rules.run_stamp(ln)}): p99 push latency and the MB of "
            "deltas taken in per second as emulated replicas are added, ours against the socket "
            "sink; hollow markers are counts past the bound. `python benchmarks/plot_capacity.py` "
            "draws it."
        )
    return "\n\n".join(parts)


def markers(name: str) -> tuple[str, str]:
    """The lines that open and close the generated block ``name``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def block(name: str, results: dict[str, list[dict]]) -> str:
    """What the generated block ``name`` holds, from ``results``."""
    if name == "figures":
        return figures_block(results)
    if name == "sizing":
        return sizing_sentence(results.get("time_to_accuracy") or [])
    if name == "table1":
        return table1_block(results.get("table1") or [])
    if name == "server-optimizer":
        return optimizer_block(results.get("server_optimizer") or [])
    if name == "scaling":
        return scaling_block(results.get("scaling") or [])
    raise ValueError(f"no generated block {name!r}")


def _replace(text: str, page: Path, name: str, body: str) -> str:
    start, end = markers(name)
    if start not in text or end not in text:
        raise SystemExit(f"{page.relative_to(ROOT)} has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def render(text: str, results: dict[str, list[dict]] | None = None, page: Path = README) -> str:
    """``text`` (``page``'s) with the generated blocks ``page`` holds (``PAGES``) rewritten from
    ``results`` (default: the stored lines)."""
    results = load_results() if results is None else results
    for name in PAGES[page]:
        text = _replace(text, page, name, block(name, results))
    return text


def generated(results: dict[str, list[dict]] | None = None) -> dict[Path, str]:
    """Each generated file and what it should hold: the pages with generated blocks (the README,
    docs/setup.md, docs/table1.md, docs/benchmarks.md) and docs/results.md."""
    results = load_results() if results is None else results
    out = {page: render(page.read_text(), results, page) for page in PAGES}
    out[RESULTS_MD] = results_page(results)
    return out


def stale(results: dict[str, list[dict]] | None = None) -> list[Path]:
    """The generated files that do not hold what the stored lines say."""
    return [
        path
        for path, text in generated(results).items()
        if not path.exists() or path.read_text() != text
    ]


def draw(results: dict[str, list[dict]]) -> list[Path]:
    """Redraw the plots whose data is stored (Table 1's curves, time to accuracy, capacity,
    scaling); none without matplotlib. Returns the files written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    import plot_capacity
    import plot_scaling
    import plot_table1
    import plot_time_to_accuracy

    written = []
    t1 = results.get("table1") or []
    if plain_and_newest(t1):
        plot_table1.plot(t1, plot_table1.OUT)
        written.append(plot_table1.OUT)
    tta = results.get("time_to_accuracy") or []
    if tta and tta_curves(tta[-1]):
        plot_time_to_accuracy.plot(tta[-1], plot_time_to_accuracy.OUT)
        written.append(plot_time_to_accuracy.OUT)
    cap = results.get("capacity") or []
    if cap and capacity_curves(cap[-1]):
        plot_capacity.plot(cap[-1], plot_capacity.OUT)
        written.append(plot_capacity.OUT)
    scaling = results.get("scaling") or []
    if any(scaling_series(ln) for ln in scaling):
        plot_scaling.plot(scaling, plot_scaling.OUT)
        written.append(plot_scaling.OUT)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if a generated file (the README, docs/setup.md, docs/table1.md, "
        "docs/benchmarks.md, docs/results.md) is stale",
    )
    args = p.parse_args(argv)
    results = load_results()
    if args.check:
        old = stale(results)
        for path in old:
            print(
                f"{path.relative_to(ROOT)} is out of date: run python benchmarks/report.py",
                file=sys.stderr,
            )
        return 1 if old else 0
    for path, text in generated(results).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for path in draw(results):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
