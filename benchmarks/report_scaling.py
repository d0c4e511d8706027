"""docs/benchmarks.md's scaling block (issue 47), from ``benchmarks/results/scaling.jsonl``: every stored
line as a row (the run's stamp, the replicas x threads and DATA workers the machine sized, epochs
and seconds to the target, PyTorch DDP's on the same cores, their ratio, the stall, images/s
against the engine alone, the goals the line judged), then every line's replica sweep, and the
plot's data (``plot_scaling.py``). Every word is read from the line: a figure it does not hold is
a dash, a run it did not make says why (its ``missing``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import report_rules as rules

__all__ = ["GOAL_WORDS", "scaling_block", "scaling_series"]

PNG_LINK = "scaling.png"  # from docs/benchmarks.md

# a goal's key in a line's ``goals`` -> its words (an unknown key is shown as it is)
GOAL_WORDS = {
    "defaults_reach_target": "the defaults reach the target",
    "seconds_vs_peer_le_0_5": "at most 0.5x DDP's seconds",
    "sweep_all_within_4_epochs": "every swept replica count within 4 epochs",
    "stall_le_0_1": "median stall at most 0.1",
    "images_per_second_vs_engine_ge_0_8": "images/s at least 0.8x the engine's",
}


def _fig(v: Any, fmt: Callable[[float], str] = rules.num) -> str:
    """A stored figure written by ``fmt``, or a dash where the line holds none."""
    return fmt(float(v)) if rules.is_num(v) else "—"


# goals judged on wall-clock speed: a line from a busy machine claims none of them
SPEED_GOALS = ("seconds_vs_peer_le_0_5", "images_per_second_vs_engine_ge_0_8")


def _pct(v: Any) -> str:
    return f"{100 * v:g}%" if rules.is_num(v) else "the target"


def _to_target(epochs: Any, seconds: Any, accuracy: Any, target: str) -> str:
    """``2 epochs, 23.1 s`` to the target; ``not reached in 10 epochs (last 98.90%)``; or ``—``
    where the run stored no accuracy."""
    accs = rules.nums(accuracy)
    if rules.is_num(epochs):
        n = int(epochs)
        secs = f", {_fig(seconds)} s" if rules.is_num(seconds) else ""
        return f"{n} epoch{'s' * (n != 1)}{secs}"
    if accs:
        return f"{target} not reached in {len(accs)} epoch{'s' * (len(accs) != 1)} (last {rules.pc(accs[-1])})"
    return "—"


def _missing(line: dict, *prefixes: str) -> str:
    """The line's reason for not running a part (its ``missing`` entries starting with one of
    ``prefixes``), or ""."""
    found = [m for m in line.get("missing") or [] if str(m).startswith(prefixes)]
    return "; ".join(str(m) for m in found)


def _peer(line: dict) -> str:
    where = (
        f"{line['peer_processes']} x {line['peer_threads']}"
        if rules.is_num(line.get("peer_processes"), line.get("peer_threads"))
        else "?"
    )
    if not rules.nums(line.get("peer_accuracy")):
        why = _missing(line, "ddp", "torch")
        return f"{where}: not run" + (f" ({why})" if why else "")
    cell = _to_target(
        line.get("peer_epochs_to_target"),
        line.get("peer_seconds_to_target"),
        line.get("peer_accuracy"),
        _pct(line.get("target")),
    )
    return f"{where}: {cell}"


def _stall(v: Any) -> str:
    vals = rules.nums(v)
    if not vals:
        return _fig(v)
    med = statistics.median(vals)
    return f"{rules.num(med)} (median of {len(vals)} epoch{'s' * (len(vals) != 1)})"


def _vs_engine(line: dict) -> str:
    r, ours, engine = (
        line.get("images_per_second_vs_engine"),
        line.get("images_per_second_median"),
        line.get("engine_images_per_second"),
    )
    if not rules.is_num(r):
        return "—"
    out = _fig(r, rules.ratio)
    if rules.is_num(ours, engine):
        out += f" ({_fig(ours)} vs {_fig(engine)} images/s)"
    return out


def _goals(line: dict) -> str:
    """The goals the line judged, by verdict; a busy line's goals of speed are not claimed."""
    goals = line.get("goals")
    if not isinstance(goals, dict) or not goals:
        return "—"
    busy = bool(rules.busy(line))
    verdicts = {
        k: ("busy" if busy and k in SPEED_GOALS and v is not None else v) for k, v in goals.items()
    }
    parts = []
    for verdict, name in (
        (True, "met"),
        (False, "missed"),
        (None, "not measured"),
        ("busy", "not claimed from a busy machine"),
    ):
        keys = [GOAL_WORDS.get(str(k), str(k)) for k, v in verdicts.items() if v is verdict]
        if keys:
            parts.append(f"{name}: " + ", ".join(keys))
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _stamp(line: dict) -> str:
    return rules.run_stamp(line) + (", no claim of speed" if rules.busy(line) else "")


def _line_row(line: dict) -> str:
    target = _pct(line.get("target"))
    ratio = line.get("seconds_vs_peer")
    return _row(
        [
            _stamp(line),
            f"{line.get('replicas', '?')} x {line.get('threads', '?')}",
            str(line["data_nodes"]) if rules.is_num(line.get("data_nodes")) else "—",
            target,
            _to_target(
                line.get("epochs_to_target"),
                line.get("seconds_to_target"),
                line.get("accuracy"),
                target,
            ),
            _peer(line),
            f"{_fig(ratio, rules.ratio)} the time" if rules.is_num(ratio) else "—",
            _stall(line.get("stall_fraction")),
            _vs_engine(line),
            _goals(line),
        ]
    )


def _sweep_rows(line: dict) -> list[str]:
    target = _pct(line.get("target"))
    rows = []
    for s in line.get("sweep") or []:
        if not isinstance(s, dict):
            continue
        where = f"{s.get('replicas', '?')} x {s.get('threads', '?')}"
        if "error" in s:
            rows.append(_row([_stamp(line), where, f"failed: {s['error']}", "—", "—", "—"]))
            continue
        rate = s.get("images_per_second")
        rows.append(
            _row(
                [
                    _stamp(line),
                    where,
                    _to_target(
                        s.get("epochs_to_target"),
                        s.get("seconds_to_target"),
                        s.get("accuracy"),
                        target,
                    ),
                    _fig(rate),
                    _fig(s.get("stall_fraction")),
                    ", ".join(f"{100 * a:.2f}" for a in rules.nums(s.get("accuracy"))) or "—",
                ]
            )
        )
    return rows


def scaling_series(line: dict) -> dict[str, dict[str, list]]:
    """The plot's data from one line: ``{"ours": ..., "ddp": ..., "defaults": ...}``, each
    ``{"replicas": [...], "images_per_second": [...], "epochs_to_target": [...]}`` (None where
    the run stored no figure or missed the target); a part the line lacks is left out."""
    out: dict[str, dict[str, list]] = {}
    sweep = [
        s
        for s in line.get("sweep") or []
        if isinstance(s, dict) and rules.is_num(s.get("replicas")) and "error" not in s
    ]
    if sweep:
        sweep.sort(key=lambda s: s["replicas"])
        out["ours"] = {
            "replicas": [s["replicas"] for s in sweep],
            "images_per_second": [s.get("images_per_second") for s in sweep],
            "epochs_to_target": [s.get("epochs_to_target") for s in sweep],
        }
    if rules.nums(line.get("peer_accuracy")) and rules.is_num(line.get("peer_processes")):
        out["ddp"] = {
            "replicas": [line["peer_processes"]],
            "images_per_second": [line.get("peer_images_per_second")],
            "epochs_to_target": [line.get("peer_epochs_to_target")],
        }
    if rules.nums(line.get("accuracy")) and rules.is_num(line.get("replicas")):
        out["defaults"] = {
            "replicas": [line["replicas"]],
            "images_per_second": [line.get("images_per_second_median")],
            "epochs_to_target": [line.get("epochs_to_target")],
        }
    return out


def scaling_block(lines: list[dict]) -> str:
    """The block: every stored line, every line's sweep, and the plot when there is data."""
    if not lines:
        return "No stored `scaling` run yet (`python benchmarks/scaling.py`)."
    rows = [
        "| run (date, commit, CPUs) | replicas x threads (defaults) | DATA workers | target "
        "| ours: epochs, seconds to the target | PyTorch DDP (processes x threads): epochs, "
        "seconds | ours / DDP | stall fraction | images/s vs the engine alone | goals |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(_line_row(ln) for ln in lines),
    ]
    parts = ["\n".join(rows)]
    sweep = [r for ln in lines for r in _sweep_rows(ln)]
    if sweep:
        parts.append(
            "\n".join(
                [
                    "Each line's sweep (`--trainers R --threads max(1, cores // R)`):",
                    "",
                    "| run (date, commit, CPUs) | replicas x threads | epochs, seconds to the "
                    "target | images/s (median of the epochs after the first; the first when "
                    "only one ran) | stall fraction (median) | test accuracy per epoch (%) |",
                    "| --- | --- | --- | --- | --- | --- |",
                    *sweep,
                ]
            )
        )
    drawn = sum(1 for ln in lines if scaling_series(ln))
    if drawn:
        parts.append(
            f"![Images/s and epochs to the target by replica count: ours and DDP]({PNG_LINK})\n\n"
            f"Images/s and epochs to the target by replica count, from the {drawn} stored "
            f"`scaling` line{'s' * (drawn != 1)} with a sweep, a DDP run or a defaults run: "
            "ours swept, the defaults, DDP. `python benchmarks/plot_scaling.py` draws it."
        )
    return "\n\n".join(parts)
