"""docs/benchmarks.md's server-optimizer block (issue 41), from
``benchmarks/results/server_optimizer.jsonl``: every stored line (one per setting and run, each
seed's final test accuracy), then what the lines say of the communication goal: the best
optimizer pushing every 4096 images against ``sum`` pushing every 512, same replicas and epochs,
newest lines first; and of the bandwidth goal: on a namespace cluster whose PS links are slow
(``--link-rate``), time to the target with the best optimizer at 4096 against ``sum`` at 512.
"""

from __future__ import annotations

import statistics

import report_rules as rules

__all__ = ["bandwidth_goal", "communication_goal", "optimizer_block", "time_to_target"]

BANDWIDTH_GOAL = 0.5  # issue 41: time to the target <= half the sum's, where links are slow


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _where(line: dict) -> str:
    """``2 x 1`` on the embedded cluster; ``2 x 1, namespace cluster, PS links 20mbit``."""
    out = f"{line['replicas']} x {line.get('threads', 1)}"
    if line.get("cluster") == "netns":
        out += f", namespace cluster, {line.get('links_shaped', 'ps').upper()} links "
        out += str(line.get("link_rate"))
    return out


def _row(line: dict) -> str:
    accs = line.get("accuracies") or []
    opt = line["optimizer"]
    if opt.startswith("nesterov"):
        opt += f" (lr {line.get('server_lr'):g}, momentum {line.get('server_momentum'):g})"
    cells = [
        rules.run_stamp(line),
        opt,
        str(line["push_every"]),
        _where(line),
        str(line["epochs"])
        + (f" at most (stops at {100 * line['target']:g}%)" if "target" in line else ""),
        f"{line['bytes_pushed_per_image']:.0f}",
        ", ".join(_pct(a) for a in accs),
        _pct(statistics.fmean(accs)) if accs else "—",
    ]
    return "| " + " | ".join(cells) + " |"


def _newest(lines: list[dict], ok) -> dict | None:
    found = [ln for ln in lines if ok(ln) and ln.get("accuracies")]
    return found[-1] if found else None


def communication_goal(lines: list[dict]) -> str:
    """The goal's sentence: the best mean at push every 4096 (the newest line of each
    optimizer) against the newest ``sum`` at 512 with the same replicas and epochs."""
    # runs to a target stop early; runs on slow links answer the bandwidth goal
    lines = [ln for ln in lines if "target" not in ln and "cluster" not in ln]
    base = _newest(lines, lambda ln: ln["optimizer"] == "sum" and ln["push_every"] == 512)
    if base is None:
        return "No stored `sum` run at push every 512 yet: the communication goal is not measured."
    same = (base["replicas"], base["epochs"])
    cands: dict[str, dict] = {}
    for ln in lines:
        if (
            ln["push_every"] == 4096
            and (ln["replicas"], ln["epochs"]) == same
            and ln.get("accuracies")
        ):
            cands[ln["optimizer"]] = ln  # the newest of each optimizer
    if not cands:
        return "No stored run at push every 4096 beside it: the communication goal is not measured."
    best = max(cands.values(), key=lambda ln: statistics.fmean(ln["accuracies"]))
    b, m = statistics.fmean(base["accuracies"]), statistics.fmean(best["accuracies"])
    ratio = base["bytes_pushed_per_image"] / best["bytes_pushed_per_image"]
    verdict = "met" if m >= b else f"missed by {100 * (b - m):.2f} points"
    n_b, n_m = len(base["accuracies"]), len(best["accuracies"])
    return (
        f"Communication goal ({base['replicas']} replicas, {base['epochs']} epochs): the best "
        f"optimizer at push every 4096, `{best['optimizer']}`, averaged {_pct(m)}% over "
        f"{n_m} seed{'s' * (n_m != 1)} against {_pct(b)}% for `sum` at 512 over {n_b} "
        f"seed{'s' * (n_b != 1)}, with {ratio:.0f}x fewer bytes pushed per image: {verdict}."
    )


def time_to_target(lines: list[dict]) -> str:
    """The runs that stopped at a target accuracy (``--target``): per optimizer and push
    interval, the newest line's seconds and epochs to it, seed by seed, and its load."""
    runs = [ln for ln in lines if "target" in ln and ln.get("seconds_to_target")]
    if not runs:
        return ""
    newest: dict[tuple, dict] = {}
    for ln in runs:
        key = (ln["optimizer"], ln["push_every"], ln["replicas"], ln["target"])
        newest[(*key, ln.get("link_rate"))] = ln
    out = []
    for (opt, k, r, target, rate), ln in newest.items():
        secs = [x for x in ln["seconds_to_target"] if x is not None]
        eps = [x for x in ln["epochs_to_target"] if x is not None]
        missed = len(ln["seconds_to_target"]) - len(secs)
        words = (
            f"- `{opt}` pushing every {k}, {r} replica{'s' * (r != 1)} x {ln.get('threads')} "
            f"threads{f', PS links {rate}' if rate else ''}, to {100 * target:g}%: seconds {', '.join(f'{x:.0f}' for x in secs)} "
            f"(mean {statistics.fmean(secs):.1f}), epochs {', '.join(map(str, eps))} "
            f"(mean {statistics.fmean(eps):.1f})"
        )
        words += f"; {missed} seed{'s' * (missed != 1)} never reached it" if missed else ""
        why = rules.busy(ln)
        out.append(f"{words} ({rules.run_stamp(ln)}{'; ' + why if why else ''}).")
    return "\n".join(["Time to the target, each seed of the newest run of each setting:", *out])


def bandwidth_goal(lines: list[dict]) -> str:
    """The goal's sentence where bandwidth is scarce: on the newest link rate measured, the
    newest ``sum`` at 512 against the best optimizer at 4096 (least mean time to the target
    over the seeds that reached it), the same replicas and target. A seed of the best that
    never reached the target misses the goal (its time is unknown, past the run's end); one of
    the sum's leaves it unmeasured."""
    slow = [ln for ln in lines if ln.get("cluster") == "netns" and ln.get("seconds_to_target")]
    if not slow:
        return ""
    rate = slow[-1].get("link_rate")
    slow = [ln for ln in slow if ln.get("link_rate") == rate]
    base = _newest(slow, lambda ln: ln["optimizer"] == "sum" and ln["push_every"] == 512)
    if base is None:
        return (
            f"No stored `sum` run at push every 512 on PS links of {rate}: the bandwidth goal "
            "is not measured."
        )
    target = f"{100 * base['target']:g}%"
    if None in base["seconds_to_target"]:
        return (
            f"Bandwidth goal (PS links {rate}): not measured, since a seed of `sum` at 512 "
            f"never reached {target}."
        )
    same = (base["replicas"], base["target"])
    cands = {
        ln["optimizer"]: ln
        for ln in slow
        if ln["push_every"] == 4096
        and (ln["replicas"], ln["target"]) == same
        and any(x is not None for x in ln["seconds_to_target"])
    }
    if not cands:
        return (
            f"No stored run at push every 4096 on PS links of {rate} that reached {target}: "
            "the bandwidth goal is not measured."
        )

    def reached(ln: dict) -> list[float]:
        return [x for x in ln["seconds_to_target"] if x is not None]

    best = min(cands.values(), key=lambda ln: statistics.fmean(reached(ln)))
    b, m = statistics.fmean(base["seconds_to_target"]), statistics.fmean(reached(best))
    ratio = m / b
    n_b, n_m, n_all = (
        len(base["seconds_to_target"]),
        len(reached(best)),
        len(best["seconds_to_target"]),
    )
    missing = n_all - n_m
    if missing:
        verdict = (
            f"missed: {missing} of its {n_all} seeds never reached {target} in "
            f"{best['epochs']} epochs"
        )
    elif ratio <= BANDWIDTH_GOAL:
        verdict = "met"
    else:
        verdict = f"missed (the goal is {BANDWIDTH_GOAL:g}x)"
    why = rules.busy(base) or rules.busy(best)
    over = f"the {n_m} seeds that reached it" if missing else f"{n_m} seed{'s' * (n_m != 1)}"
    return (
        f"Bandwidth goal ({base['replicas']} replicas, PS links {rate}): the best optimizer at "
        f"push every 4096, `{best['optimizer']}`, reached {target} in {m:.1f} s on average over "
        f"{over} against {b:.1f} s for `sum` at 512 over {n_b} seed{'s' * (n_b != 1)}: "
        f"{ratio:.2f}x the time; {verdict}" + (f" ({why})" if why else "") + "."
    )


def optimizer_block(lines: list[dict]) -> str:
    """The block: every stored line, then the goal's sentence and the times to a target."""
    if not lines:
        return "No stored `server_optimizer` run yet (`python benchmarks/server_optimizer.py`)."
    rows = [
        "| run (date, commit, CPUs) | optimizer | push every | replicas x threads | epochs "
        "| bytes pushed / image | test accuracy per seed (%) | mean (%) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(_row(ln) for ln in lines),
    ]
    tta = time_to_target(lines)
    bw = bandwidth_goal(lines)
    return "\n".join(
        [
            *rows,
            "",
            communication_goal(lines),
            *(["", bw] if bw else []),
            *(["", tta] if tta else []),
        ]
    )
