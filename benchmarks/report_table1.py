"""Table 1 seed by seed, and the sizing sentence (``report.py``'s blocks in docs/table1.md
and docs/setup.md).

* Table 1: one run of each mode is noise (two runs of one recipe differ by ~0.07 points), so
  the block shows, for the recipe of the newest table1 line, the newest async/sync pair of
  every seed and their mean. When that recipe uses a regulariser the paper does not name
  (dropout, label smoothing), the block shows the newest recipe without any first, so Table 1
  is always reported without them. Those are the runs with Adam's ``sum`` on the parameter
  server; each other server optimizer (``server_optimizer``, issue 41) gets a table of its own
  after them, its newest recipe, and one sentence setting its means beside ``sum``'s.
* The sizing sentence: what the stored time_to_accuracy runs on fewer than 4 CPUs say about one
  replica vs two (the embedded cluster's sizing).
"""

from __future__ import annotations

import json
from statistics import fmean

from report_rules import is_num as _is_num
from report_rules import num as _num
from report_rules import short as _fmt

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
    "server_optimizer",
    "trainers",
    "trainer_threads",
    "overrides",
    "augment",
)
# the value a recipe key had before lines recorded it
RECIPE_DEFAULTS = {"label_smoothing": 0.0, "batch_norm": False, "server_optimizer": "sum"}
# recipe keys that are regularisers the paper does not name (0 or absent: off)
REGULARISERS = ("dropout", "label_smoothing", "batch_norm")


def _recipe(line: dict, *, but: tuple[str, ...] = ()) -> str:
    keys = [k for k in RECIPE if k not in but]
    return json.dumps({k: line.get(k, RECIPE_DEFAULTS.get(k)) for k in keys}, sort_keys=True)


def optimizer_of(line: dict) -> str:
    """The server optimizer a table1 line's runs used (``sum`` before lines recorded it)."""
    return str(line.get("server_optimizer") or RECIPE_DEFAULTS["server_optimizer"])


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
    """The lines whose recipes Table 1 is shown for: the newest with both modes and the sum on
    the parameter server, preceded by the newest without a regulariser the paper does not name
    when that is another recipe."""
    pairs = [ln for ln in _pairs(lines) if optimizer_of(ln) == "sum"]
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
    diffs: list[float] = []
    finals: dict[str, list[float]] = {"async": [], "sync": []}
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
        f"| mean of {n} | | {_pct(fmean(finals['async']))} | {_pct(fmean(finals['sync']))} "
        f"| {100 * fmean(diffs):+.2f} |"
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


def _means(lines: list[dict], like: dict) -> tuple[int, float, float]:
    """(seeds, mean async final, mean sync final) over the newest pair of each seed of
    ``like``'s recipe."""
    pairs = table1_pairs(lines, like).values()
    n = len(pairs)
    return n, fmean(a["accuracy"] for _, a, _ in pairs), fmean(s["accuracy"] for *_, s in pairs)


def other_optimizers(lines: list[dict]) -> dict[str, dict]:
    """Server optimizer other than the sum -> its newest line with both modes."""
    newest: dict[str, dict] = {}
    for ln in _pairs(lines):
        if optimizer_of(ln) != "sum":
            newest[optimizer_of(ln)] = ln
    return newest


def optimizer_tables(lines: list[dict], plain: dict | None) -> list[str]:
    """For each server optimizer other than the sum with a pair of runs: the seed-by-seed table
    of its newest recipe, and, when that recipe is ``plain``'s but for the optimizer, a sentence
    with both optimizers' means."""
    out: list[str] = []
    for name, like in other_optimizers(lines).items():
        out += ["", f"With `{name}` on the parameter server (`--server-optimizer`):", ""]
        out.append(table1_by_seed(lines, like))
        if plain is None or _recipe(plain, but=("server_optimizer",)) != _recipe(
            like, but=("server_optimizer",)
        ):
            continue
        n, a, s = _means(lines, like)
        n0, a0, s0 = _means(lines, plain)
        out += [
            "",
            f"The same recipe, `{name}` beside `sum` (mean final accuracy over {n} and {n0} "
            f"seeds): async {_pct(a)} vs {_pct(a0)} ({100 * (a - a0):+.2f}), sync {_pct(s)} vs "
            f"{_pct(s0)} ({100 * (s - s0):+.2f}).",
        ]
    return out


def table1_block(lines: list[dict]) -> str:
    """:func:`table1_by_seed` of the newest recipe with the sum on the parameter server; when it
    uses a regulariser the paper does not name, that of the newest recipe without one first;
    then each other server optimizer's (:func:`optimizer_tables`)."""
    shown = plain_and_newest(lines)
    if not shown:
        none = "No table1 line with both modes and `sum` on the parameter server yet."
        return "\n".join([none, *optimizer_tables(lines, None)])
    if len(shown) < 2:
        return "\n".join([table1_by_seed(lines, shown[0]), *optimizer_tables(lines, shown[0])])
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
            *optimizer_tables(lines, plain),
        ]
    )


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
