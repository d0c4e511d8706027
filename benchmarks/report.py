"""Write the README's measured figures from the stored benchmark lines.

Each benchmark appends one JSON line per run to ``benchmarks/results/NAME.jsonl`` (see
``_common.record``). This script rewrites the README's generated blocks from those lines, so no
figure in the README is typed by hand; ``--check`` exits 1 when the README is not up to date.

* ``<!-- figures:start -->`` ... ``<!-- figures:end -->``: a table of headline figures, one row
  per claim (:data:`CLAIMS`), each from the newest line of its benchmark: ours beside the peer
  measured in the same run, named, and their ratio in words ("0.84x the time PyTorch takes"),
  with the line's date, commit, CPU count and load. Benchmarks without a line have no row. Under
  the plots, a collapsible list per benchmark of every stored line's figures, oldest first, so
  the newest is never shown without the others.
* ``<!-- table1:start -->`` ... ``<!-- table1:end -->``: Table 1. One run of each mode is noise
  (two runs of one recipe differ by ~0.07 points), so the block shows, for the recipe of the
  newest table1 line, the newest async/sync pair of every seed and their mean. When that recipe
  uses a regulariser the paper does not name (dropout, label smoothing), the block shows the
  newest recipe without any first, so Table 1 is always reported without them.
* ``<!-- sizing:start -->`` ... ``<!-- sizing:end -->``: what the stored time_to_accuracy runs
  on fewer than 4 CPUs say about one replica vs two (the embedded cluster's sizing).

Without ``--check`` it also redraws, when matplotlib is installed and their lines are stored,
``docs/table1-curves.png`` (``plot_table1.py``), ``docs/time-to-accuracy.png``
(``plot_time_to_accuracy.py``) and ``docs/capacity.png`` (``plot_capacity.py``).

Usage: ``python benchmarks/report.py [--check]``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- figures:start -->", "<!-- figures:end -->"
T1_START, T1_END = "<!-- table1:start -->", "<!-- table1:end -->"
SIZING_START, SIZING_END = "<!-- sizing:start -->", "<!-- sizing:end -->"
TTA_PNG_LINK, CAPACITY_PNG_LINK = "docs/time-to-accuracy.png", "docs/capacity.png"
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


def save_figure(fig, out: Path) -> None:
    """Lay out ``fig``, write it to ``out`` (its folder made) and close it: every plot's end."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items() if not isinstance(x, dict | list))
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v[:8]) + (", ..." if len(v) > 8 else "") + "]"
    return str(v)


# --- the headline table: one row per claim, ours beside the peer measured in the same run ---


@dataclass(frozen=True)
class Figure:
    """What one stored line says about one claim."""

    what: str  # the claim, for a person (may name the line's settings)
    ours: str  # our figure
    peer: str  # the peer, named, and its figure
    words: str  # how the two compare, for a person ("0.84x the time PyTorch takes")
    brief: str  # the same, short, for the list of every run
    timed: bool = True  # a wall-clock figure: a busy machine's line makes no claim of it


@dataclass(frozen=True)
class Claim:
    bench: str  # benchmarks/results/BENCH.jsonl
    name: str  # short, for the column of the list of every run
    figure: Callable[[dict], Figure | None]  # None: the line does not measure this
    # the newest line that measures it (a file whose lines measure different parts), not only
    # the file's newest line
    any_line: bool = False

    def newest(self, lines: list[dict]) -> dict | None:
        """The line the headline shows for this claim."""
        for ln in reversed(lines if self.any_line else lines[-1:]):
            if self.figure(ln) is not None:
                return ln
        return None


def _num(v: float) -> str:
    """A measured figure with as many digits as a person needs: 12,661 / 922 / 34.7 / 2.29 /
    0.013."""
    a = abs(v)
    if float(v).is_integer() and a < 1000:
        return str(int(v))
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.2g}"


def _x(r: float) -> str:
    """A ratio: ``0.84x``, ``2.32x``, ``0.084x``."""
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _pc(v: float) -> str:
    return f"{100 * v:.2f}%"


def _ratio(line: dict, key: str | None, ours: float, peer: float) -> float | None:
    """The line's own ratio (``key``, computed before rounding) when it has one, else
    ours / peer."""
    if key and isinstance(line.get(key), int | float):
        return float(line[key])
    return ours / peer if peer else None


def time_words(r: float, peer: str) -> str:
    """``0.84x the time PyTorch takes``: for figures where less is better."""
    return f"{_x(r)} the time {peer} takes"


def rate_words(r: float, peer: str, unit: str) -> str:
    """``2.32x the images/s of PyTorch``: for figures where more is better."""
    return f"{_x(r)} the {unit} of {peer}"


def _goal(line: dict, key: str, bound: str) -> str:
    goal = (line.get("goals") or {}).get(key)
    return f" (goal: {bound} {_x(goal)})" if isinstance(goal, int | float) else ""


def _get(line: dict, *path: str) -> Any:
    for k in path:
        if not isinstance(line, dict):
            return None
        line = line.get(k)
    return line


def _is_num(*vs: object) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in vs)


# --- what a line can claim: its load, and differences within noise ---

# a line whose highest recorded load average is above this many runnable tasks per CPU was
# measured while other work had the machine: its wall-clock figures are shown, not claimed
BUSY_PER_CPU = 2.0
# two single measurements less than this far apart (a ratio within 10% of 1) are within noise:
# stored runs of one benchmark at one setting differ by more than that on this shared machine
# (the engine alone's images/s in the time_to_accuracy lines at load under 5: 7,361-12,272)
NOISE = 0.10
LOAD_KEYS = ("load", "load_average", "load_before", "load_after", "load_at_record")


def line_load(line: dict) -> float | None:
    """The highest load average ``line`` recorded, under any of :data:`LOAD_KEYS` (a number,
    or a list such as os.getloadavg()'s); None when it recorded none."""
    seen: list[float] = []
    for key in LOAD_KEYS:
        v = line.get(key)
        seen.extend(float(x) for x in (v if isinstance(v, list) else [v]) if _is_num(x))
    return max(seen) if seen else None


def busy(line: dict) -> str:
    """Why ``line`` makes no claim of speed (its load was above :data:`BUSY_PER_CPU` per
    CPU), or "" when it may."""
    load, cpus = line_load(line), line.get("cpus")
    if load is None or not _is_num(cpus) or not cpus or load <= BUSY_PER_CPU * cpus:
        return ""
    return (
        f"no claim of speed: measured at load {load:.1f} on {cpus} CPUs (more than "
        f"{BUSY_PER_CPU:g} runnable per CPU: other work had the machine)"
    )


def _nums(v: object) -> list[float]:
    return [float(x) for x in v if _is_num(x)] if isinstance(v, list) else []


def _overlap(a: list[float], b: list[float]) -> bool:
    """Both sides measured at least twice and their ranges overlap."""
    return len(a) > 1 and len(b) > 1 and min(a) <= max(b) and min(b) <= max(a)


def _span(v: list[float], unit: str) -> str:
    return f"{_num(min(v))}-{_num(max(v))} {unit}".rstrip()


def speed_words(
    line: dict,
    words: str,
    r: float,
    *,
    ours_runs: object = None,
    peer_runs: object = None,
    unit: str = "",
) -> str:
    """``words`` (a speed ratio ``r`` in words) as the line may claim it: not at all from a busy
    machine, "within noise" when the runs of the two sides overlap or ``r`` is within
    :data:`NOISE` of 1."""
    why = busy(line)
    if why:
        return why
    ours, peer = _nums(ours_runs), _nums(peer_runs)
    if _overlap(ours, peer):
        return f"within noise: the runs overlap ({_span(ours, unit)} vs {_span(peer, unit)})"
    if abs(r - 1) < NOISE:
        return f"within noise: {words}, under {100 * NOISE:g}% apart"
    return words


def _versus(
    line: dict,
    what: str,
    ours: float | None,
    peer: float | None,
    *,
    unit: str,
    peer_name: str,
    less_is_better: bool,
    ratio_key: str | None = None,
    goal_key: str | None = None,
    ours_note: str = "",
    peer_note: str = "",
    peer_label: str | None = None,
    ours_runs: object = None,
    peer_runs: object = None,
) -> Figure | None:
    """The common claim: our figure beside the peer's, in ``unit`` (``"s"``, ``"MB/s"``...)."""
    if not _is_num(ours):
        return None
    assert ours is not None
    label = peer_label or peer_name
    ours_text = f"{_num(ours)} {unit}{ours_note}"
    if not _is_num(peer) or not peer:
        return Figure(
            what, ours_text, f"{peer_name}: not run", "no peer in this run", f"{_num(ours)} {unit}"
        )
    assert peer is not None
    r = _ratio(line, ratio_key, ours, peer)
    assert r is not None
    runs = {"ours_runs": ours_runs, "peer_runs": peer_runs, "unit": unit}
    if less_is_better:
        words = speed_words(line, time_words(r, peer_name), r, **runs)
        words += _goal(line, goal_key, "at most") if goal_key else ""
    else:
        words = speed_words(line, rate_words(r, peer_name, unit), r, **runs)
        words += _goal(line, goal_key, "at least") if goal_key else ""
    return Figure(
        what,
        ours_text,
        f"{label}: {_num(peer)} {unit}{peer_note}",
        words,
        f"{_num(ours)} {unit} vs {_num(peer)} {unit} ({_x(r)})",
    )


def _target(line: dict) -> str:
    return f"{100 * line.get('target', 0.99):g}%"


def _tta_torch(ln: dict) -> Figure | None:
    return _versus(
        ln,
        f"Time to {_target(ln)} MNIST test accuracy: `adam-dask train`, embedded cluster",
        ln.get("ours_seconds_to_target"),
        ln.get("torch_seconds_to_target"),
        unit="s",
        peer_name="PyTorch",
        peer_label=f"PyTorch, same network, {ln.get('torch_threads', '?')} threads",
        less_is_better=True,
        ratio_key="ours_over_torch",
        goal_key="ours_over_torch",
        ours_note=f" ({ln.get('ours_epochs', '?')} epochs)",
        peer_note=f" ({ln.get('torch_epochs', '?')} epochs)",
    )


def _tta_engine(ln: dict) -> Figure | None:
    return _versus(
        ln,
        f"Time to {_target(ln)}: the whole system vs its engine alone (one process, no cluster)",
        ln.get("ours_seconds_to_target"),
        ln.get("engine_seconds_to_target"),
        unit="s",
        peer_name="the engine alone",
        less_is_better=True,
        ratio_key="ours_over_engine",
        goal_key="ours_over_engine",
        ours_note=f" ({ln.get('ours_epochs', '?')} epochs)",
        peer_note=f" ({ln.get('engine_epochs', '?')} epochs)",
    )


def _tta_rate(ln: dict) -> Figure | None:
    return _versus(
        ln,
        "Training images/s: the whole system vs its engine alone (same run, same threads)",
        ln.get("ours_images_per_second"),
        ln.get("engine_images_per_second"),
        unit="images/s",
        peer_name="the engine alone",
        peer_label=(
            f"the engine alone in the same `time_to_accuracy` run ({ln.get('activation', '?')}, "
            f"{ln.get('engine_epochs', '?')} epochs, {ln.get('engine_threads', '?')} threads)"
        ),
        less_is_better=False,
        goal_key="images_per_second_vs_engine",
    )


def _engine(ln: dict) -> Figure | None:
    return _versus(
        ln,
        f"Engine training images/s (`engine.py`, not the `time_to_accuracy` run): one replica, "
        f"{ln.get('threads', '?')} Hogwild threads, {ln.get('images', '?')} images, mini-batch "
        f"{ln.get('batch_size', '?')}",
        ln.get("images_per_s"),
        ln.get("torch_images_per_s"),
        unit="images/s",
        peer_name="PyTorch",
        peer_label="PyTorch, same network",
        less_is_better=False,
        ratio_key="ratio",
    )


def _ps_transfer(kind: str) -> Callable[[dict], Figure | None]:
    def figure(ln: dict) -> Figure | None:
        fig = _versus(
            ln,
            f"PS {kind}: {_num(ln.get('payload_mb', 0))} MB in {_num(ln.get('shard_mb', 0))} "
            f'MB shards x {ln.get("copies", "?")} copies, `ack="{ln.get("ack", "?")}"`',
            ln.get(f"{kind}_mb_per_s"),
            ln.get(f"raw_{kind}_mb_per_s"),
            unit="MB/s",
            peer_name="a raw actor round trip",
            less_is_better=False,
            ratio_key=f"{kind}_vs_raw",
            goal_key=f"{kind}_vs_raw",
        )
        return fig

    return figure


def _plane(kind: str) -> Callable[[dict], Figure | None]:
    """The data plane against a plain TCP socket between the same two processes (the
    ``plane`` part of a ps line): the MNIST net's delta, and 4 MB."""

    def figure(ln: dict) -> Figure | None:
        plane = ln.get("plane") or {}
        m = plane.get("mnist") or {}
        r, r4 = ln.get(f"{kind}_vs_socket"), ln.get(f"{kind}_4mb_vs_socket")
        key = "push_donated_mb_per_s" if kind == "push" else "pull_mb_per_s"
        ours, peer = (m.get("auto") or {}).get(key), m.get(f"socket_{kind}_mb_per_s")
        if not (_is_num(r) and _is_num(ours) and _is_num(peer)):
            return None
        what = (
            f"Data plane {kind}: the MNIST net's {_num(m.get('mb', 0))} MB (and 4 MB) from a "
            "TRAIN worker task to the PS nodes, at a replica's cadence"
        )
        words = speed_words(ln, rate_words(r, "a plain TCP socket", "MB/s"), r) + _goal(
            ln, f"{kind}_vs_socket", "at least"
        )
        if _is_num(r4) and not busy(ln):
            words += f"; 4 MB: {_x(r4)}"
        return Figure(
            what,
            f"{_num(ours)} MB/s",
            f"a plain TCP socket between the same two processes: {_num(peer)} MB/s",
            words,
            f"{_x(r)} socket" + (f", 4 MB {_x(r4)}" if _is_num(r4) else ""),
        )

    return figure


def _client_plane(kind: str) -> Callable[[dict], Figure | None]:
    """A notebook's back-to-back push or pull through the public API at its defaults, against a
    plain TCP socket from the same process (the ``client_back_to_back`` part of a ps line)."""

    def figure(ln: dict) -> Figure | None:
        plane = ln.get("plane") or {}
        m = (plane.get("mnist") or {}).get("client_back_to_back") or {}
        f = (plane.get("4mb") or {}).get("client_back_to_back") or {}
        r, r4 = m.get(f"{kind}_vs_socket"), f.get(f"{kind}_vs_socket")
        ours, peer = m.get(f"{kind}_mb_per_s"), m.get(f"socket_{kind}_mb_per_s")
        if not (_is_num(r) and _is_num(ours) and _is_num(peer)):
            return None
        what = (
            f"A client's back-to-back {kind} of the MNIST net's "
            f"{_num(plane['mnist'].get('mb', 0))} MB (and 4 MB): `ParameterServer.{kind}`, "
            "defaults, embedded cluster, mean over every call"
        )
        words = speed_words(ln, rate_words(r, "a plain TCP socket", "MB/s"), r)
        words += " (goal: at least 0.80x)"
        if _is_num(r4) and not busy(ln):
            words += f"; 4 MB: {_x(r4)}"
        return Figure(
            what,
            f"{_num(ours)} MB/s",
            f"a plain TCP socket from the client's process to a PS worker's: {_num(peer)} MB/s",
            words,
            f"client {kind} {_x(r)} socket" + (f", 4 MB {_x(r4)}" if _is_num(r4) else ""),
        )

    return figure


_DATA_PATH_KINDS = {
    "offload": "the dense offload",
    "partitions": "2 partitions",
    "sync": "sync mode",
    "large": "a 20M-parameter model",
    "sigkill": "a PS primary SIGKILLed",
}


def _data_path(ln: dict) -> Figure | None:
    """Which transport carried the pushes and pulls the nodes served, after a fit of each kind
    (``data_path`` lines): the words name the kinds the line ran and their counts."""
    kinds = ln.get("kinds") or {}
    done = {k: v for k, v in kinds.items() if isinstance(v.get("by_transport"), dict)}
    if not done:
        return None
    plane = sum(v["by_transport"]["plane"] for v in done.values())
    dask = sum(v["by_transport"]["dask"] for v in done.values())
    named = ", ".join(_DATA_PATH_KINDS.get(k, k) for k in done)
    each = "; ".join(
        f"{_DATA_PATH_KINDS.get(k, k)}: {v['by_transport']['plane']:,} / "
        f"{v['by_transport']['dask']:,}"
        + ("" if v.get("applied_once") else " (not every image applied once)")
        + (" (the fit ended before the kill)" if k == "sigkill" and not v.get("killed") else "")
        for k, v in done.items()
    )
    failed = [k for k, v in kinds.items() if k not in done]
    if failed:
        each += "; failed: " + ", ".join(failed)
    return Figure(
        f"Pushes and pulls the PS nodes served, by transport, after one MNIST epoch of each: "
        f"{named} ({_num(ln.get('images', 0))} images)",
        f"{plane:,} on the data plane",
        f"as Dask actor calls: {dask:,}",
        f"plane / Dask per fit: {each} (goal: none as Dask actor calls)",
        f"plane {plane:,}, Dask {dask:,}",
        timed=False,
    )


def _failover(signal: str, how: str) -> Callable[[dict], Figure | None]:
    def figure(ln: dict) -> Figure | None:
        served, healed = ln.get(f"{signal}_served_seconds"), ln.get(f"{signal}_healed_seconds")
        goal = (ln.get("goals") or {}).get("served_seconds")
        if not _is_num(served):
            return None
        lost = ln.get(f"{signal}_lost_max_abs")
        ours = f"pushes served again after {_num(served)} s" + (
            f", every shard back at full copies after {_num(healed)} s" if _is_num(healed) else ""
        )
        if _is_num(lost):
            ours += (
                "; no acknowledged update lost or applied twice"
                if lost == 0
                else f"; parameters off by up to {lost}"
            )
        what = f"Fail-over: {how} while pushes run"
        if not _is_num(goal):
            return Figure(what, ours, "no peer", "no goal in this run", f"{_num(served)} s")
        return Figure(
            what,
            ours,
            f"the benchmark's goal: {_num(goal)} s",
            busy(ln) or f"{_x(served / goal)} the {_num(goal)} s goal",
            f"{_num(served)} s",
        )

    return figure


def _ps_cost(ln: dict) -> Figure | None:
    return _versus(
        ln,
        f'The safe default\'s cost: training images/s with `ack="{ln.get("ack", "?")}"`',
        ln.get("train_images_per_s"),
        ln.get("primary_train_images_per_s"),
        unit="images/s",
        peer_name='`ack="primary"`',
        peer_label='`ack="primary"` (acknowledged once the primary has it)',
        less_is_better=False,
    )


def _at(curve: list, replicas: object) -> dict:
    return next(
        (p for p in curve or [] if isinstance(p, dict) and p.get("replicas") == replicas), {}
    )


def _served(point: dict) -> str:
    p99 = _p99_key(point)
    parts = [f"{_num(point['mb_per_s'])} MB/s" if _is_num(point.get("mb_per_s")) else ""]
    parts.append(f"p99 push {_num(point[p99])} ms" if p99 and _is_num(point.get(p99)) else "")
    shown = ", ".join(p for p in parts if p)
    return f" ({shown})" if shown else ""


def _capacity(ln: dict) -> Figure | None:
    ours, sink = ln.get("replicas_served"), ln.get("sink_replicas_served")
    if not _is_num(ours):
        return None
    period = ln.get("push_period_ms")
    what = (
        "PS capacity: emulated replicas one PS group serves with p99 push at most "
        f"{_num(ln.get('p99_bound_ms', 0))} ms"
        + (
            f", each pushing {_num(ln['delta_bytes'] / 2**20)} MB every {_num(period)} ms"
            if _is_num(ln.get("delta_bytes"), period)
            else ""
        )
    )
    ours_text = f"{ours} replicas{_served(_at(ln.get('curve'), ours))}"
    peer = "a socket sink (the machine's limit)"
    if not _is_num(sink) or not sink:
        return Figure(what, ours_text, f"{peer}: not run", "no peer in this run", f"{ours}")
    r = _ratio(ln, "served_vs_sink", ours, sink)
    assert r is not None
    return Figure(
        what,
        ours_text,
        f"{peer}: {sink} replicas{_served(_at(ln.get('sink_curve'), sink))}",
        speed_words(ln, f"{_x(r)} the replicas the socket sink serves", r),
        f"{ours} vs {sink} ({_x(r)})",
    )


def _chaos(ln: dict) -> Figure | None:
    if "completed" not in ln:
        return None
    acc, clean = ln.get("test_accuracy") or [], ln.get("clean_test_accuracy") or []
    # the faults the line says were sent, by kind (not the kinds it could draw from), and
    # those it could not send (``faults_not_sent``: "kind: error")
    faults = ln.get("faults")
    sent = Counter(f.get("kind", "?") for f in faults or [])
    count = len(faults) if isinstance(faults, list) else ln.get("fault_count", "?")
    missed = Counter(
        (str(f).split(":")[0] if not isinstance(f, dict) else f.get("kind", "?"))
        for f in ln.get("faults_not_sent") or []
    )

    def kinds(c: Counter) -> str:
        return ", ".join(f"{n}x {k}" if n > 1 else k for k, n in sorted(c.items()))

    where = " on a cluster of network namespaces" if ln.get("netns") else ""
    what = (
        f"Training through {count} fault{'' if count == 1 else 's'} sent from outside{where}"
        + (f" ({kinds(sent)})" if sent else "")
        + (f"; {sum(missed.values())} not sent ({kinds(missed)})" if missed else "")
        + f", {ln.get('epochs', '?')} epochs of {_num(ln.get('n_train', 0))} images"
    )
    peer = "the same run undisturbed: " + (
        f"{_pc(clean[-1])} in {_num(ln['clean_seconds'])} s" if clean else "did not finish"
    )
    if not ln["completed"]:
        error = str(ln.get("error") or "?").split(":")[0]
        return Figure(
            what,
            f"did not finish ({error}) after {ln.get('epochs_done', 0)} epochs",
            peer,
            "did not finish",
            f"ended ({error})",
        )
    once = ln.get("every_image_applied_once")
    ours = (
        f"finished; every image applied once: {'yes' if once else 'no'}; "
        f"{_pc(acc[-1]) if acc else '?'} in {_num(ln['seconds'])} s"
    )
    words, brief = "finished", "finished"
    if acc and clean:
        words = f"{100 * (acc[-1] - clean[-1]):+.2f} points of accuracy"
        brief = f"finished, {_pc(acc[-1])} vs {_pc(clean[-1])}"
        if _is_num(ln.get("clean_seconds")) and ln["clean_seconds"]:
            r = ln["seconds"] / ln["clean_seconds"]
            words += ", " + speed_words(ln, time_words(r, "the undisturbed run"), r)
    brief += "" if once else ", not every image once"
    return Figure(what, ours, peer, words, brief)


def _after_first(ln: dict, quorum: str) -> float | None:
    """The mean epoch seconds of the quorum's run without its first epoch (``detail``)."""
    secs = _get(ln, "detail", quorum, "epoch_seconds")
    return _mean(secs[1:]) if isinstance(secs, list) and len(secs) > 1 else None


def _quorum(ln: dict) -> Figure | None:
    q, full = ln.get("epoch_seconds_quorum_0_75"), ln.get("epoch_seconds_quorum_1_0")
    fig = _versus(
        ln,
        f"Epoch quorum 0.75 vs 1.0: {ln.get('replicas', '?')} replicas, one slowed by "
        f"{ln.get('slow_replica_delay_per_batch', '?')} s per batch",
        q,
        full,
        unit="s",
        peer_name="quorum 1.0",
        less_is_better=True,
        ours_runs=_get(ln, "detail", "0.75", "epoch_seconds"),
        peer_runs=_get(ln, "detail", "1.0", "epoch_seconds"),
    )
    a, b = ln.get("accuracy_quorum_0_75"), ln.get("accuracy_quorum_1_0")
    if fig is None or not _is_num(a, b):
        return fig
    words = f"{fig.words}, {100 * (a - b):+.2f} points of accuracy"
    # the first epoch of a run can hold a warm-up the later ones do not: say what the later
    # epochs alone give, when the line has them
    q_later, full_later = _after_first(ln, "0.75"), _after_first(ln, "1.0")
    if q_later is not None and full_later and not busy(ln):
        words += (
            f"; {_x(q_later / full_later)} without each run's first epoch "
            f"({_num(q_later)} s vs {_num(full_later)} s)"
        )
    return Figure(
        fig.what,
        f"{fig.ours} per epoch, {_pc(a)}",
        f"{fig.peer} per epoch, {_pc(b)}",
        words,
        fig.brief,
    )


def _table1(ln: dict) -> Figure | None:
    if "async" not in ln:
        return None
    link = "[Table 1, seed by seed](#table-1-seed-by-seed)"
    return Figure(
        "The paper's Table 1: asynchronous vs synchronous accuracy",
        f"see {link}",
        "the paper's figures and our synchronous runs",
        f"see {link}",
        ", ".join(
            f"{mode} {_pc(ln[f'{mode}_accuracy'])}"
            for mode in ("async", "sync")
            if _is_num(ln.get(f"{mode}_accuracy"))
        ),
        timed=False,
    )


def _ingest(ln: dict) -> Figure | None:
    return _versus(
        ln,
        "Ingest MNIST IDX into Zarr, images/s",
        ln.get("ingest_images_per_s"),
        ln.get("read_idx_images_per_s"),
        unit="images/s",
        peer_name="decompressing and parsing the IDX files alone",
        less_is_better=False,
        ratio_key="ratio_ingest_to_read",
    )


def _serving(ln: dict) -> Figure | None:
    return _versus(
        ln,
        f"Augmented images/s served by {ln.get('data_nodes', '?')} DATA worker(s)",
        ln.get("augmented_images_per_s"),
        ln.get("torch_loader_images_per_s"),
        unit="images/s",
        peer_name="a PyTorch DataLoader",
        less_is_better=False,
        ratio_key="speedup_vs_torch",
    )


def _mean(v: object) -> float | None:
    if isinstance(v, list):
        v = [x for x in v if _is_num(x)]
        return sum(v) / len(v) if v else None
    return float(v) if isinstance(v, int | float) else None


def _serving_faults(ln: dict) -> Figure | None:
    scenario = ln.get("scenario", "?")
    fig = _versus(
        ln,
        f"Epoch seconds with a DATA worker frozen (SIGSTOP), `{scenario}`",
        _mean(ln.get("epoch_seconds")),
        _mean(ln.get("baseline_epoch_seconds")),
        unit="s",
        peer_name="the undisturbed epoch",
        less_is_better=True,
        ours_runs=ln.get("epoch_seconds"),
        peer_runs=ln.get("baseline_epoch_seconds"),
    )
    if fig is None:
        return None
    return Figure(fig.what, fig.ours, fig.peer, fig.words, f"{scenario}: {fig.brief}", fig.timed)


def _pipelines(ln: dict) -> Figure | None:
    return _versus(
        ln,
        f"Reprocess pipeline: {ln.get('images', '?')} raw images in S3 to Zarr in S3, "
        f"{ln.get('augmented_epochs', 0)} pre-augmented epoch(s)",
        ln.get("reprocess_seconds"),
        ln.get("ingest_only_seconds"),
        unit="s",
        peer_name="ingest alone",
        less_is_better=True,
        ratio_key="reprocess_over_ingest_only",
    )


def _resume(ln: dict) -> Figure | None:
    first = ln.get("first_push_seconds")
    if not _is_num(first):
        return None
    lost, again = ln.get("images_lost_at_crash"), ln.get("images_retrained")
    n, applied = ln.get("n_train"), ln.get("images_applied")
    return Figure(
        f"Resume mid-epoch after the whole cluster is SIGKILLed ({n} training images)",
        f"first push {_num(first)} s after the resume call; {lost} images lost, {again} "
        f"re-trained; {applied} of {n} applied",
        f"none: what the checkpoint held, {ln.get('images_in_checkpoint', '?')} of {n} images",
        "every image applied once" if applied == n else f"{applied} of {n} images applied",
        f"{_num(first)} s, lost {lost}",
        timed=False,
    )


def _large_model(ln: dict) -> Figure | None:
    ps = ln.get("ps") or {}
    fig = _versus(
        ps,
        f"{ln.get('model', '?')}-parameter dense net: PS push ({_num(ps.get('payload_mb', 0))} MB)",
        ps.get("push_mb_per_s"),
        ps.get("raw_push_mb_per_s"),
        unit="MB/s",
        peer_name="a raw actor transfer",
        less_is_better=False,
        ratio_key="push_vs_raw",
    )
    if fig is None:
        return None
    sent = ln.get("offload_sent_bytes_ratio")
    words = fig.words + (
        f"; the dense offload sends {_x(sent)} the bytes per image" if _is_num(sent) else ""
    )
    return Figure(fig.what, fig.ours, fig.peer, words, f"{ln.get('model')}: {fig.brief}")


def _large_model_links(ln: dict) -> Figure | None:
    """A line of ``large_model.py --netns RATE``: an epoch with the dense offload against one
    without, on links limited to RATE, and the bytes that crossed them."""
    plain, off = ln.get("train") or {}, ln.get("train_offload") or {}
    if not ln.get("link_rate") or not _is_num(off.get("wall_seconds"), plain.get("wall_seconds")):
        return None
    fig = _versus(
        ln,
        f"The dense offload (paper 3.2.6) where bandwidth is scarce: the {ln.get('model', '?')}"
        f"-parameter dense net, {off.get('images', '?')} images, every link limited to "
        f"{ln['link_rate']}",
        off["wall_seconds"],
        plain["wall_seconds"],
        unit="s",
        peer_name="the same run without the offload",
        less_is_better=True,
        ratio_key="offload_epoch_seconds_ratio",
    )
    if fig is None:
        return None
    link = ln.get("offload_sent_bytes_ratio")
    words = fig.words + (f"; {_x(link)} the bytes on the links per image" if _is_num(link) else "")
    return Figure(fig.what, fig.ours, fig.peer, words, f"{ln.get('link_rate')}: {fig.brief}")


def _isolation(ln: dict) -> Figure | None:
    iso, shared = ln.get("isolated") or {}, ln.get("shared") or {}
    keys = ("probe_busy_ms_p50", "probe_idle_ms_p50", "probe_busy_ms_p99")
    if not all(_is_num(d.get(k)) for d in (iso, shared) for k in keys):
        return None

    def run(d: dict) -> str:
        return (
            f"p50 {_num(d['probe_busy_ms_p50'])} ms (idle {_num(d['probe_idle_ms_p50'])} ms), "
            f"p99 {_num(d['probe_busy_ms_p99'])} ms"
        )

    p50 = shared["probe_busy_ms_p50"] / iso["probe_busy_ms_p50"]
    p99 = shared["probe_busy_ms_p99"] / iso["probe_busy_ms_p99"]
    return Figure(
        f"Communication isolation (paper 3.3.4): a replica's push and pull of one "
        f"{ln.get('probe_kb', '?')} KiB shard while the write-back of a "
        f"{_num(ln.get('model_mb', 0))} MB layer fills {ln.get('rate', '?')} links",
        "storage on a link of its own: " + run(iso),
        "storage on the update link: " + run(shared),
        busy(ln) or f"shared storage makes a round {_x(p50)} slower at p50, {_x(p99)} at p99",
        f"shared/isolated p50 {_x(p50)}, p99 {_x(p99)}",
    )


def _torch_engine_time(ln: dict) -> Figure | None:
    what = (
        f"The paper's net as an `nn.Module`: time to {_target(ln)} through the Trainer, "
        "torch engine vs numba engine (same cluster, same run)"
    )
    curve = ln.get("torch_curve") or []
    if ln.get("torch_seconds_to_target") is None and curve and _is_num(*curve):
        peer = ln.get("numba_seconds_to_target")
        mb = f", mini-batch {ln['torch_batch_size']}" if "torch_batch_size" in ln else ""
        ours = f"not reached in {len(curve)} epochs (best {_pc(max(curve))}{mb})"
        return Figure(
            what,
            ours,
            f"the numba engine: {_num(peer)} s" if _is_num(peer) else "the numba engine: -",
            "the target was not reached",
            ours,
        )
    return _versus(
        ln,
        what,
        ln.get("torch_seconds_to_target"),
        ln.get("numba_seconds_to_target"),
        unit="s",
        peer_name="the numba engine",
        less_is_better=True,
        ratio_key="torch_over_numba_seconds",
        ours_note=f" ({ln.get('torch_epochs', '?')} epochs)",
        peer_note=f" ({ln.get('numba_epochs', '?')} epochs)",
    )


def _torch_engine_rate(ln: dict) -> Figure | None:
    mb = f" (torch mini-batch {ln['torch_batch_size']})" if "torch_batch_size" in ln else ""
    return _versus(
        ln,
        "The paper's net as an `nn.Module`: training images/s, torch engine vs numba engine" + mb,
        ln.get("torch_images_per_second"),
        ln.get("numba_images_per_second"),
        unit="images/s",
        peer_name="the numba engine",
        less_is_better=False,
        ratio_key="torch_over_numba_rate",
    )


def _torch_resnet(ln: dict) -> Figure | None:
    return _versus(
        ln,
        f"A small ResNet (`nn.Module`, batch norm): time to {_target(ln)} MNIST through the "
        "Trainer",
        ln.get("ours_seconds_to_target"),
        ln.get("torch_seconds_to_target"),
        unit="s",
        peer_name="PyTorch",
        peer_label=f"plain PyTorch, same module, {ln.get('torch_threads', '?')} threads",
        less_is_better=True,
        ratio_key="ours_over_torch",
        ours_note=f" ({ln.get('ours_epochs', '?')} epochs)",
        peer_note=f" ({ln.get('torch_epochs', '?')} epochs)",
    )


def _partitions_mnist(ln: dict) -> Figure | None:
    if ln.get("part") != "mnist":
        return None
    p1, p2 = ln.get("mean_accuracy_p1"), ln.get("mean_accuracy_p2")
    if not _is_num(p1, p2):
        return None
    seeds, n, e = ln.get("seeds"), ln.get("images"), ln.get("epochs")
    d = 100 * (p2 - p1)
    a1, a2 = _nums(ln.get("accuracy_p1")), _nums(ln.get("accuracy_p2"))
    acc = f"{d:+.2f} points"
    if _overlap(a2, a1):
        acc += (
            f", within noise: the seeds overlap ({100 * min(a2):.2f}-{_pc(max(a2))} vs "
            f"{100 * min(a1):.2f}-{_pc(max(a1))})"
        )
    r = ln.get("rate_ratio_p2_vs_p1")
    rate = (
        speed_words(
            ln,
            f"images/s {_x(r)} of P = 1",
            r,
            ours_runs=ln.get("images_per_second_p2"),
            peer_runs=ln.get("images_per_second_p1"),
            unit="images/s",
        )
        if _is_num(r)
        else "images/s not measured"
    )
    return Figure(
        f"The paper's MNIST net with one replica over 2 TRAIN workers (partitions), {seeds} "
        f"seeds, {n} images x {e} epochs",
        f"P = 2: {_pc(p2)} mean test accuracy",
        f"P = 1 (the replica on one worker): {_pc(p1)}",
        f"{acc}; {rate}",
        f"{_pc(p2)} vs {_pc(p1)}",
    )


def _partitions_large(ln: dict) -> Figure | None:
    if ln.get("part") != "large":
        return None
    acc = ln.get("accuracy") or {}
    if not acc:
        return None
    best = max(acc, key=lambda k: int(k))
    refused = sorted(ln.get("refused") or {}, key=int)
    rates = ln.get("images_per_second") or {}
    return Figure(
        f"A {ln.get('spec')} net (too large for one TRAIN worker of "
        f"{ln.get('worker_memory_limit')}) on MNIST, {ln.get('images')} images, 1 epoch",
        "; ".join(f"P = {k}: {_pc(v)}, {_num(rates.get(k, 0))} images/s" for k, v in acc.items()),
        "P = " + ", ".join(refused) + ": refused before starting" if refused else "none refused",
        f"learns with P = {', '.join(acc)} (chance 10%)",
        f"P={best}: {_pc(acc[best])}",
        timed=False,
    )


def _partitions_cache(ln: dict) -> Figure | None:
    if ln.get("part") != "cache" or not _is_num(ln.get("sum_alone_vs_whole_seconds")):
        return None
    r = ln["sum_alone_vs_whole_seconds"]
    mib = ln.get("stage_weight_mib") or []
    return Figure(
        f"The paper's cache claim: {ln.get('spec')} one layer per partition "
        f"({', '.join(str(m) for m in mib)} MiB each), one thread",
        f"each layer alone: {_x(r)} the time",
        f"the same layers unpartitioned: {_num(ln.get('unpartitioned_images_per_second', 0))} "
        "images/s",
        speed_words(ln, f"{_x(r)} the time with each partition's weights to itself", r),
        f"{_x(r)} the time",
    )


CLAIMS: tuple[Claim, ...] = (
    Claim("time_to_accuracy", "vs PyTorch", _tta_torch),
    Claim("time_to_accuracy", "vs the engine alone", _tta_engine),
    Claim("time_to_accuracy", "images/s vs the engine alone", _tta_rate),
    Claim("engine", "images/s vs PyTorch", _engine),
    Claim("ps", "push MB/s", _ps_transfer("push")),
    Claim("ps", "pull MB/s", _ps_transfer("pull")),
    Claim("ps", "data-plane push vs a socket", _plane("push")),
    Claim("ps", "data-plane pull vs a socket", _plane("pull")),
    Claim("ps", "client push vs a socket", _client_plane("push"), any_line=True),
    Claim("ps", "client pull vs a socket", _client_plane("pull"), any_line=True),
    Claim("capacity", "replicas served", _capacity),
    Claim("data_path", "pushes and pulls by transport", _data_path),
    Claim("ps", "SIGKILL fail-over", _failover("sigkill", "a primary's PS worker SIGKILLed")),
    Claim("ps", "SIGSTOP fail-over", _failover("sigstop", "a primary's PS worker SIGSTOPped")),
    Claim("ps", "images/s vs ack=primary", _ps_cost),
    Claim("chaos", "through faults", _chaos),
    Claim("quorum", "quorum 0.75 vs 1.0", _quorum),
    Claim("table1", "Table 1", _table1),
    Claim("ingest", "ingest", _ingest),
    Claim("serving", "serving", _serving),
    Claim("serving_faults", "frozen DATA worker", _serving_faults),
    Claim("pipelines", "reprocess vs ingest", _pipelines),
    Claim("resume", "resume", _resume),
    Claim("large_model", "push MB/s", _large_model),
    Claim("large_model", "offload on limited links", _large_model_links),
    Claim("isolation", "shared vs isolated storage", _isolation),
    Claim("torch_engine", "time, torch vs numba engine", _torch_engine_time),
    Claim("torch_engine", "images/s, torch vs numba engine", _torch_engine_rate),
    Claim("torch_resnet", "ResNet vs PyTorch", _torch_resnet),
    Claim("partitions", "MNIST net P=2 vs P=1", _partitions_mnist, any_line=True),
    Claim("partitions", "too large for one worker", _partitions_large, any_line=True),
    Claim("partitions", "cache: layers alone", _partitions_cache, any_line=True),
)


def load_results(folder: Path = RESULTS) -> dict[str, list[dict]]:
    """Every stored line, by benchmark (the file's stem), oldest first."""
    return {p.stem: read_lines(p) for p in sorted(folder.glob("*.jsonl"))}


def _load(line: dict) -> str:
    v = line_load(line)
    return f", load {v:.1f}" if v is not None else ", load not recorded"


def run_stamp(line: dict) -> str:
    """``2026-11-23, f7ac4bf, 2 CPUs, load 4.2``: when, at which commit, on what machine (the
    highest load average the line recorded, or that it recorded none)."""
    return (
        f"{str(line.get('date', '?'))[:10]}, {line.get('commit', '?')}, "
        f"{line.get('cpus', '?')} CPUs{_load(line)}"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def headline(results: dict[str, list[dict]]) -> str:
    """The table of headline figures: one row per claim its benchmark's newest line measures
    (a benchmark without a line has no row), then which benchmarks have none and which stored
    files the table does not summarise."""
    rows = [
        "| claim | ours | peer | in words | newest run (date, commit, CPUs) | stored runs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    shown = shown_benchmarks(results)
    for claim in CLAIMS:
        lines = results.get(claim.bench) or []
        line = claim.newest(lines)
        if line is None:
            continue
        fig = claim.figure(line)
        assert fig is not None
        rows.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    fig.what,
                    fig.ours,
                    fig.peer,
                    fig.words,
                    run_stamp(line),
                    f"{len(lines)} in `{claim.bench}`",
                )
            )
            + " |"
        )
    out = ["\n".join(rows)]
    missing = sorted({c.bench for c in CLAIMS} - set(shown))
    if missing:
        out.append(
            "No stored line measures these yet: " + ", ".join(f"`{b}`" for b in missing) + "."
        )
    others = sorted(set(results) - {c.bench for c in CLAIMS})
    if others:
        out.append(
            "Stored but not summarised here (see `benchmarks/results/`): "
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


def every_run(bench: str, lines: list[dict]) -> str:
    """A collapsible list of every stored line of ``bench``: its stamp and what it says about
    each of the benchmark's claims."""
    claims = [c for c in CLAIMS if c.bench == bench]
    rows = [
        "| run (date, commit, CPUs) | " + " | ".join(c.name for c in claims) + " |",
        "| --- |" + " --- |" * len(claims),
    ]
    for ln in lines:
        figs = [c.figure(ln) for c in claims]
        # a busy machine's line: its timings are listed, not claimed
        stamp = run_stamp(ln) + (
            ", no claim of speed" if busy(ln) and any(f and f.timed for f in figs) else ""
        )
        rows.append(
            f"| {_cell(stamp)} | "
            + " | ".join(_cell(f.brief) if f and f.brief else "—" for f in figs)
            + " |"
        )
    n = len(lines)
    return "\n".join(
        [
            f"<details><summary><code>{bench}</code>: all {n} stored run{'s' * (n != 1)}</summary>",
            "",
            *rows,
            "",
            "</details>",
        ]
    )


# --- the plots' data (drawn by plot_time_to_accuracy.py and plot_capacity.py) ---

TTA_RUNS = (
    ("ours", "ours: adam-dask train, embedded cluster"),
    ("engine", "the engine alone"),
    ("torch", "PyTorch"),
)


def tta_curves(line: dict) -> dict[str, list[float]]:
    """label -> test accuracy after each epoch, for each run the time_to_accuracy line holds a
    curve of (ours, the engine alone, PyTorch), the label saying its seconds to the target."""
    out = {}
    for key, name in TTA_RUNS:
        curve = line.get(f"{key}_curve")
        if not curve:
            continue
        secs = line.get(f"{key}_seconds_to_target")
        reached = f"{_target(line)} in {_num(secs)} s" if _is_num(secs) else "target not reached"
        out[f"{name} ({reached})"] = list(curve)
    return out


def _p99_key(point: dict) -> str | None:
    """The point's p99 push latency key (``push_ms_p99``; any ``p99`` key with ``push``)."""
    if "push_ms_p99" in point:
        return "push_ms_p99"
    return next((k for k in point if "p99" in k and "push" in k), None)


def capacity_curves(line: dict) -> dict[str, dict[str, list]]:
    """``{"ours": ..., "socket sink": ...}`` from a capacity line's ``curve`` and
    ``sink_curve``, each ``{"replicas": [...], "p99_ms": [...], "mb_per_s": [...],
    "within": [...]}`` (``within``: the count met the line's bound); empty without a curve."""
    out = {}
    for name, key in (("ours", "curve"), ("socket sink", "sink_curve")):
        points = [p for p in line.get(key) or [] if isinstance(p, dict) and "replicas" in p]
        if not points:
            continue
        p99 = _p99_key(points[0])
        out[name] = {
            "replicas": [p["replicas"] for p in points],
            "p99_ms": [p.get(p99) if p99 else None for p in points],
            "mb_per_s": [p.get("mb_per_s") for p in points],
            "within": [bool(p.get("within", True)) for p in points],
        }
    return out if "ours" in out else {}


# --- the README: the figures block, the sizing sentence, Table 1 ---


def sizing_sentence(lines: list[dict]) -> str:
    """What the stored time_to_accuracy runs say about replicas on small machines: epochs to
    the target and median images/s by replica count, on each CPU count below 4."""
    groups: dict[tuple, dict[int, list[dict]]] = {}
    for ln in lines:
        if not _is_num(ln.get("ours_epochs"), ln.get("ours_replicas"), ln.get("cpus")):
            continue
        if ln["cpus"] >= 4:
            continue
        key = (ln["cpus"], ln.get("target", 0.99))
        groups.setdefault(key, {}).setdefault(ln["ours_replicas"], []).append(ln)
    if not groups:
        return "No stored `time_to_accuracy` run on fewer than 4 CPUs yet."
    out = []
    for (cpus, target), by_replicas in sorted(groups.items()):
        parts = []
        for replicas, runs in sorted(by_replicas.items()):
            epochs = ", ".join(str(r["ours_epochs"]) for r in runs)
            rates = sorted(
                r["ours_images_per_second"]
                for r in runs
                if _is_num(r.get("ours_images_per_second"))
            )
            median = (
                rates[len(rates) // 2]
                if len(rates) % 2
                else sum(rates[len(rates) // 2 - 1 : len(rates) // 2 + 1]) / 2
            )
            parts.append(
                f"{epochs} epochs with {replicas} replica{'s' * (replicas != 1)}"
                + (f" (median {_num(median)} images/s)" if rates else "")
            )
        out.append(
            f"On {cpus} CPUs the stored `time_to_accuracy` runs reached {100 * target:g}% in "
            + " and in ".join(parts)
            + "."
        )
    return " ".join(out)


def figures_block(results: dict[str, list[dict]]) -> str:
    """The README's Measured block: the headline table, the plots whose data is stored, and
    every stored run of each benchmark in the table."""
    parts = [
        "One row per claim, from the newest stored line of its benchmark, beside the peer "
        "measured in the same run; *stored runs* counts the benchmark's lines, every one "
        "of them listed below the plots. Wall-clock figures come from a shared machine: each row "
        "gives the CPU count and the highest load average its line recorded (or that it recorded "
        f"none). A line recorded at a load above {BUSY_PER_CPU:g} per CPU makes no claim of "
        "speed; two figures whose repeated runs overlap, or single figures less than "
        f"{100 * NOISE:g}% apart, are within noise and said to be. The words of each row (which "
        "faults, how many, which run a figure comes from) are read from its line.",
        headline(results),
    ]
    tta = results.get("time_to_accuracy") or []
    if tta and tta_curves(tta[-1]):
        ln = tta[-1]
        parts.append(
            f"![Test accuracy per epoch: ours, the engine alone, PyTorch]({TTA_PNG_LINK})\n\n"
            f"Test accuracy after each epoch in the newest `time_to_accuracy` run "
            f"({run_stamp(ln)}), plotted per epoch: the line stores no time per epoch (the "
            f"seconds to {_target(ln)} are in the legend and the table). "
            "`python benchmarks/plot_time_to_accuracy.py` draws it."
        )
    cap = results.get("capacity") or []
    if cap and capacity_curves(cap[-1]):
        ln = cap[-1]
        parts.append(
            f"![Parameter-server capacity: p99 push latency and MB/s by replicas]"
            f"({CAPACITY_PNG_LINK})\n\n"
            f"The newest `capacity` run ({run_stamp(ln)}): p99 push latency and the MB of deltas "
            "taken in per second as emulated replicas are added, ours against the socket sink; "
            "hollow markers are counts past the bound. `python benchmarks/plot_capacity.py` "
            "draws it."
        )
    shown = shown_benchmarks(results)
    if shown:
        parts.append(
            "Every stored run, oldest first (each cell: ours vs the peer and their ratio; — "
            "where the line does not measure it):"
        )
        parts.extend(every_run(b, results[b]) for b in shown)
    return "\n\n".join(parts)


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


def render(readme: str, results: dict[str, list[dict]] | None = None) -> str:
    """``readme`` with its generated blocks (figures, Table 1, the sizing sentence) rewritten
    from ``results`` (default: the stored lines)."""
    results = load_results() if results is None else results
    out = _replace(readme, START, END, figures_block(results))
    out = _replace(out, T1_START, T1_END, table1_block(results.get("table1") or []))
    return _replace(
        out, SIZING_START, SIZING_END, sizing_sentence(results.get("time_to_accuracy") or [])
    )


def draw(results: dict[str, list[dict]]) -> list[Path]:
    """Redraw the plots whose data is stored (Table 1's curves, time to accuracy, capacity);
    none without matplotlib. Returns the files written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    import plot_capacity
    import plot_table1
    import plot_time_to_accuracy

    written = []
    t1 = results.get("table1") or []
    if _pairs(t1):
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
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = p.parse_args(argv)
    text = README.read_text()
    results = load_results()
    new = render(text, results)
    if args.check:
        if new != text:
            print(
                "README.md figures are out of date: run python benchmarks/report.py",
                file=sys.stderr,
            )
            return 1
        return 0
    README.write_text(new)
    for path in draw(results):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
