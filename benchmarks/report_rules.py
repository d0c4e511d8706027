"""What a stored line may claim, and how its figures are written (``report.py``'s rules).

Every claim of the README's table goes through these, so each rule is written once:

* **Numbers** for a person: :func:`num` (12,661 / 922 / 34.7 / 2.29 / 0.013), :func:`ratio`
  (0.84x), :func:`pc` (98.73%).
* **The load shown**: :func:`run_stamp` names the line's date, commit, CPU count and the highest
  load average it recorded under any of :data:`LOAD_KEYS` (or that it recorded none).
* **No claim of speed from a busy machine**: :func:`busy` says why a line recorded above
  :data:`BUSY_PER_CPU` runnable tasks per CPU makes no claim of speed; its wall-clock figures
  are shown, not claimed.
* **Within noise**: :func:`speed_words` says "within noise" where the repeated runs of the two
  sides overlap, or a single ratio is less than :data:`NOISE` from 1.
"""

from __future__ import annotations

from statistics import fmean
from typing import Any

# a line whose highest recorded load average is above this many runnable tasks per CPU was
# measured while other work had the machine: its wall-clock figures are shown, not claimed
BUSY_PER_CPU = 2.0
# two single measurements less than this far apart (a ratio within 10% of 1) are within noise:
# stored runs of one benchmark at one setting differ by more than that on this shared machine
# (the engine alone's images/s in the time_to_accuracy lines at load under 5: 7,361-12,272)
NOISE = 0.10
LOAD_KEYS = ("load", "load_average", "load_before", "load_after", "load_at_record")


def is_num(*vs: object) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in vs)


def get(line: Any, path: str) -> Any:
    """``line``'s value at ``path`` (keys joined by ``/``: ``plane/mnist/mb``); None where a key
    is missing."""
    for key in path.split("/"):
        if not isinstance(line, dict):
            return None
        line = line.get(key)
    return line


def num(v: float) -> str:
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


def ratio(r: float) -> str:
    """A ratio: ``0.84x``, ``2.32x``, ``0.084x``."""
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def pc(v: float) -> str:
    """A fraction as a percentage: ``98.73%``."""
    return f"{100 * v:.2f}%"


def nums(v: object) -> list[float]:
    """The numbers of a list (none when ``v`` is not a list)."""
    return [float(x) for x in v if is_num(x)] if isinstance(v, list) else []


def mean(v: object) -> float | None:
    """The mean of a list's numbers, or the number itself; None without one."""
    if isinstance(v, list):
        v = nums(v)
        return fmean(v) if v else None  # fmean sums exactly: the same digits on every Python
    return float(v) if isinstance(v, int | float) else None


# --- the load shown, and what a loaded line may claim ---


def line_load(line: dict) -> float | None:
    """The highest load average ``line`` recorded, under any of :data:`LOAD_KEYS` (a number,
    or a list such as os.getloadavg()'s); None when it recorded none."""
    seen: list[float] = []
    for key in LOAD_KEYS:
        v: Any = line.get(key)
        seen.extend(float(x) for x in (v if isinstance(v, list) else [v]) if is_num(x))
    return max(seen) if seen else None


def run_stamp(line: dict) -> str:
    """``2026-11-23, f7ac4bf, 2 CPUs, load 4.2``: when, at which commit, on what machine (the
    highest load average the line recorded, or that it recorded none)."""
    v = line_load(line)
    load = f", load {v:.1f}" if v is not None else ", load not recorded"
    return (
        f"{str(line.get('date', '?'))[:10]}, {line.get('commit', '?')}, "
        f"{line.get('cpus', '?')} CPUs{load}"
    )


def busy(line: dict) -> str:
    """Why ``line`` makes no claim of speed (its load was above :data:`BUSY_PER_CPU` per
    CPU), or "" when it may."""
    load, cpus = line_load(line), line.get("cpus")
    if load is None or not is_num(cpus) or not cpus or load <= BUSY_PER_CPU * cpus:
        return ""
    return (
        f"no claim of speed: measured at load {load:.1f} on {cpus} CPUs (more than "
        f"{BUSY_PER_CPU:g} runnable per CPU: other work had the machine)"
    )


def overlap(a: list[float], b: list[float]) -> bool:
    """Both sides measured at least twice and their ranges overlap."""
    return len(a) > 1 and len(b) > 1 and min(a) <= max(b) and min(b) <= max(a)


def _span(v: list[float], unit: str) -> str:
    return f"{num(min(v))}-{num(max(v))} {unit}".rstrip()


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
    ours, peer = nums(ours_runs), nums(peer_runs)
    if overlap(ours, peer):
        return f"within noise: the runs overlap ({_span(ours, unit)} vs {_span(peer, unit)})"
    if abs(r - 1) < NOISE:
        return f"within noise: {words}, under {100 * NOISE:g}% apart"
    return words


def short(v: object) -> str:
    """A stored value in a few words: 4 significant digits, a dict's scalars, a list's first 8."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {short(x)}" for k, x in v.items() if not isinstance(x, dict | list))
    if isinstance(v, list):
        return "[" + ", ".join(short(x) for x in v[:8]) + (", ..." if len(v) > 8 else "") + "]"
    return str(v)
