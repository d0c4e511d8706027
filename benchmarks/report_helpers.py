"""The few claims whose line needs more than a lookup: named helpers the table
(``report_claims.CLAIMS``) refers to.

A ``values`` helper returns the derived figures its claim's templates read (None: the line does
not measure the claim); a ``figure`` helper returns the whole row, for a claim whose row has
branches (a chaos run that did not finish, a torch run that never reached the target). Both
say only what the line holds, and go through ``report_rules`` for what a line may claim.
"""

from __future__ import annotations

from collections import Counter
from statistics import fmean
from typing import Any

import report_record as record
import report_rules as rules
from report_record import Claim, Figure

# --- values: derived figures for a claim's templates ---

DATA_PATH_KINDS = {
    "offload": "the dense offload",
    "partitions": "2 partitions",
    "sync": "sync mode",
    "large": "a 20M-parameter model",
    "sigkill": "a PS primary SIGKILLed",
}


def data_path(line: dict) -> dict[str, Any] | None:
    """Which transport carried the pushes and pulls the nodes served, after a fit of each kind
    (``data_path`` lines): the kinds the line ran, named, and their counts."""
    kinds = line.get("kinds") or {}
    done = {k: v for k, v in kinds.items() if isinstance(v.get("by_transport"), dict)}
    if not done:
        return None
    each = "; ".join(
        f"{DATA_PATH_KINDS.get(k, k)}: {v['by_transport']['plane']:,} / "
        f"{v['by_transport']['dask']:,}"
        + ("" if v.get("applied_once") else " (not every image applied once)")
        + (" (the fit ended before the kill)" if k == "sigkill" and not v.get("killed") else "")
        for k, v in done.items()
    )
    failed = [k for k in kinds if k not in done]
    return {
        "named": ", ".join(DATA_PATH_KINDS.get(k, k) for k in done),
        "plane": sum(v["by_transport"]["plane"] for v in done.values()),
        "dask": sum(v["by_transport"]["dask"] for v in done.values()),
        "each": each + ("; failed: " + ", ".join(failed) if failed else ""),
    }


def lost(line: dict) -> dict[str, str]:
    """``sigkill_lost`` / ``sigstop_lost``: what a fail-over did to acknowledged updates."""
    out = {}
    for signal in ("sigkill", "sigstop"):
        v = line.get(f"{signal}_lost_max_abs")
        if rules.is_num(v):
            out[f"{signal}_lost"] = (
                "no acknowledged update lost or applied twice"
                if v == 0
                else f"parameters off by up to {v}"
            )
    return out


def p99_key(point: dict) -> str | None:
    """The point's p99 push latency key (``push_ms_p99``; any ``p99`` key with ``push``)."""
    if "push_ms_p99" in point:
        return "push_ms_p99"
    return next((k for k in point if "p99" in k and "push" in k), None)


def _served(curve: object, replicas: object) -> str:
    """`` (900 MB/s, p99 push 15.2 ms)``: the curve's point at ``replicas``."""
    points = curve if isinstance(curve, list) else []
    point = next((p for p in points if isinstance(p, dict) and p.get("replicas") == replicas), {})
    p99 = p99_key(point)
    parts = [f"{rules.num(point['mb_per_s'])} MB/s" if rules.is_num(point.get("mb_per_s")) else ""]
    parts.append(
        f"p99 push {rules.num(point[p99])} ms" if p99 and rules.is_num(point.get(p99)) else ""
    )
    shown = ", ".join(p for p in parts if p)
    return f" ({shown})" if shown else ""


def capacity(line: dict) -> dict[str, Any]:
    """The MB/s and p99 at the replicas each side serves; the delta in MB."""
    out: dict[str, Any] = {
        "ours_point": _served(line.get("curve"), line.get("replicas_served")),
        "sink_point": _served(line.get("sink_curve"), line.get("sink_replicas_served")),
    }
    if rules.is_num(line.get("delta_bytes")):
        out["delta_mb"] = line["delta_bytes"] / 2**20
    return out


def _after_first(line: dict, quorum: str) -> float | None:
    """The mean epoch seconds of the quorum's run without its first epoch (``detail``)."""
    secs = rules.get(line, f"detail/{quorum}/epoch_seconds")
    return rules.mean(secs[1:]) if isinstance(secs, list) and len(secs) > 1 else None


def quorum(line: dict) -> dict[str, Any]:
    """Each quorum's accuracy, their difference in points, and (the first epoch of a run can
    hold a warm-up the later ones do not) the ratio of the later epochs alone."""
    a, b = rules.get(line, "accuracy_quorum_0_75"), rules.get(line, "accuracy_quorum_1_0")
    if not rules.is_num(a, b):
        return {}
    out = {"acc_ours": a, "acc_peer": b, "points": 100 * (a - b)}
    q_later, full_later = _after_first(line, "0.75"), _after_first(line, "1.0")
    if q_later is not None and full_later:
        out.update(q_later=q_later, full_later=full_later, later_ratio=q_later / full_later)
    return out


def means(line: dict) -> dict[str, Any]:
    """The mean epoch seconds of each side of a ``serving_faults`` line."""
    return {
        "epoch_mean": rules.mean(line.get("epoch_seconds")),
        "baseline_mean": rules.mean(line.get("baseline_epoch_seconds")),
    }


def table1(line: dict) -> dict[str, Any] | None:
    """A table1 line's accuracy of each mode (the rows are in the Table 1 block)."""
    if "async" not in line:
        return None
    return {
        "modes": ", ".join(
            f"{mode} {rules.pc(line[f'{mode}_accuracy'])}"
            for mode in ("async", "sync")
            if rules.is_num(line.get(f"{mode}_accuracy"))
        )
    }


def resume(line: dict) -> dict[str, Any]:
    applied, n = line.get("images_applied"), line.get("n_train")
    return {
        "applied_words": (
            "every image applied once" if applied == n else f"{applied} of {n} images applied"
        )
    }


def isolation(line: dict) -> dict[str, Any] | None:
    """How much slower a round is with storage on the update link, at p50 and p99."""
    iso, shared = line.get("isolated") or {}, line.get("shared") or {}
    keys = ("probe_busy_ms_p50", "probe_idle_ms_p50", "probe_busy_ms_p99")
    if not all(rules.is_num(d.get(k)) for d in (iso, shared) for k in keys):
        return None
    if not (iso["probe_busy_ms_p50"] and iso["probe_busy_ms_p99"]):
        return None
    return {
        "p50": shared["probe_busy_ms_p50"] / iso["probe_busy_ms_p50"],
        "p99": shared["probe_busy_ms_p99"] / iso["probe_busy_ms_p99"],
    }


def partitions_accuracy(line: dict) -> dict[str, Any]:
    """P = 2's mean accuracy against P = 1's in points; within noise where the seeds overlap."""
    p1, p2 = rules.get(line, "mean_accuracy_p1"), rules.get(line, "mean_accuracy_p2")
    if not rules.is_num(p1, p2):
        return {}
    a1, a2 = rules.nums(line.get("accuracy_p1")), rules.nums(line.get("accuracy_p2"))
    acc = f"{100 * (p2 - p1):+.2f} points"
    if rules.overlap(a2, a1):
        acc += (
            f", within noise: the seeds overlap ({100 * min(a2):.2f}-{rules.pc(max(a2))} vs "
            f"{100 * min(a1):.2f}-{rules.pc(max(a1))})"
        )
    return {"acc": acc}


def runner_accuracy(line: dict) -> dict[str, Any]:
    """A whole model through the pipeline against run_replica tasks: mean test accuracy of
    each, the difference in points, within noise where the seeds overlap, and how many
    replicas (``who``)."""
    a_p, a_r = rules.nums(line.get("accuracy_pipeline")), rules.nums(line.get("accuracy_replica"))
    if not a_p or not a_r:
        return {}
    m_p, m_r = fmean(a_p), fmean(a_r)
    acc = f"accuracy {100 * (m_p - m_r):+.2f} points"
    if rules.overlap(a_p, a_r):
        acc += f", within noise: the seeds overlap ({100 * min(a_p):.2f}-{rules.pc(max(a_p))} vs "
        acc += f"{100 * min(a_r):.2f}-{rules.pc(max(a_r))})"
    R = int(line.get("replicas") or 1)  # lines before --runner-replicas ran one
    who = "one replica" if R == 1 else f"{R} replicas of one thread each"
    return {"acc": acc, "mean_pipeline": m_p, "mean_replica": m_r, "who": who}


def partitions_large(line: dict) -> dict[str, Any] | None:
    """What each partition count learnt, and which counts were refused before starting."""
    acc = line.get("accuracy") or {}
    if not acc:
        return None
    best = max(acc, key=lambda k: int(k))
    refused = sorted(line.get("refused") or {}, key=int)
    rates = line.get("images_per_second") or {}
    return {
        "per_p": "; ".join(
            f"P = {k}: {rules.pc(v)}, {rules.num(rates.get(k, 0))} images/s" for k, v in acc.items()
        ),
        "refused_text": "P = " + ", ".join(refused) + ": refused before starting"
        if refused
        else "none refused",
        "learnt": ", ".join(acc),
        "best": best,
        "best_acc": acc[best],
    }


# --- figure: the claims whose row has branches ---


def _kinds(c: Counter) -> str:
    return ", ".join(f"{n}x {k}" if n > 1 else k for k, n in sorted(c.items()))


def faults(line: dict) -> str:
    """``12 faults sent from outside (2x freeze-data, ...); 1 not sent (kill-shard)``: the
    faults the line says were sent, counted and named by kind (not the kinds it could draw
    from), and those it could not send (``faults_not_sent``: "kind: error")."""
    sent_list = line.get("faults")
    sent = Counter(f.get("kind", "?") for f in sent_list or [])
    count = len(sent_list) if isinstance(sent_list, list) else line.get("fault_count", "?")
    missed = Counter(
        (str(f).split(":")[0] if not isinstance(f, dict) else f.get("kind", "?"))
        for f in line.get("faults_not_sent") or []
    )
    where = " on a cluster of network namespaces" if line.get("netns") else ""
    return (
        f"{count} fault{'' if count == 1 else 's'} sent from outside{where}"
        + (f" ({_kinds(sent)})" if sent else "")
        + (f"; {sum(missed.values())} not sent ({_kinds(missed)})" if missed else "")
    )


def _measured(line: dict, run: str) -> list[float]:
    """[median, max] of the load average a chaos line sampled during its ``run`` (none: [])."""
    v = rules.get(line, f"load_measured/{run}")
    return v if isinstance(v, list) and len(v) == 2 and rules.is_num(*v) else []


def noise(line: dict) -> str:
    """The noisy neighbours a chaos line ran beside, in words: the worker its ``throttle`` held
    under a CPU quota, the busy processes of its ``--load`` and the load measured meanwhile
    ("" for a line with neither)."""
    out = ""
    quota = rules.get(line, "throttle/quota")
    if isinstance(quota, dict) and rules.is_num(quota.get("fraction"), quota.get("seconds")):
        how = (
            f"{quota.get('mechanism')} CFS quota, throttled in {quota.get('throttled_periods')}"
            f" of {quota.get('periods')} periods"
            if str(quota.get("mechanism", "")).startswith("cgroup")
            else "SIGSTOP/SIGCONT duty cycle"
        )
        out += (
            f"; a {line['throttle'].get('role', '?')} worker held to "
            f"{100 * quota['fraction']:g}% of a core for {rules.num(quota['seconds'])} s ({how})"
        )
    busy, per_core = line.get("busy_processes"), line.get("load_per_core")
    if rules.is_num(busy, per_core) and busy:
        out += f"; {busy} busy process{'es' * (busy != 1)} ({per_core:g} per core)"
        alive = line.get("busy_alive") or {}
        fewer = [
            f"as few as {alive[run]} running in the {name} run"
            for run, name in (("faulted", "faulted"), ("clean", "undisturbed"))
            if rules.is_num(alive.get(run)) and alive[run] < busy
        ]
        out += " started, " + ", ".join(fewer) if fewer else " beside both runs"
    shown = [
        f"median {rules.num(v[0])}, max {rules.num(v[1])} in the {name} run"
        for run, name in (("faulted", "faulted"), ("clean", "undisturbed"))
        if (v := _measured(line, run))
    ]
    if shown:
        out += "; load average " + "; ".join(shown)
    return out


def chaos(claim: Claim, line: dict) -> Figure | None:
    """A training run through faults: did it finish, was every image applied once, its
    accuracy and time beside the same run undisturbed; the noisy neighbours it ran beside and
    its slowest epoch beside the undisturbed run's median."""
    if "completed" not in line:
        return None
    acc, clean = line.get("test_accuracy") or [], line.get("clean_test_accuracy") or []
    what = record.fill(claim.what, [{"faults": faults(line), "noise": noise(line)}, line])
    peer = "the same run undisturbed: " + (
        f"{rules.pc(clean[-1])} in {rules.num(line['clean_seconds'])} s"
        if clean
        else "did not finish"
    )
    neighbours = ""  # for the list of every run
    if rules.get(line, "throttle/role"):
        neighbours += f", a {line['throttle']['role']} worker throttled"
    if rules.is_num(line.get("load_per_core")) and line.get("busy_processes"):
        neighbours += f", {line['load_per_core']:g} busy per core"
    if not line["completed"]:
        error = str(line.get("error") or "?").split(":")[0]
        return Figure(
            what,
            f"did not finish ({error}) after {line.get('epochs_done', 0)} epochs",
            peer,
            "did not finish",
            f"ended ({error}){neighbours}",
        )
    once = line.get("every_image_applied_once")
    ours = (
        f"finished; every image applied once: {'yes' if once else 'no'}; "
        f"{rules.pc(acc[-1]) if acc else '?'} in {rules.num(line['seconds'])} s"
    )
    words, brief = "finished", "finished"
    if acc and clean:
        words = f"{100 * (acc[-1] - clean[-1]):+.2f} points of accuracy"
        brief = f"finished, {rules.pc(acc[-1])} vs {rules.pc(clean[-1])}"
        if rules.is_num(line.get("clean_seconds")) and line["clean_seconds"]:
            r = line["seconds"] / line["clean_seconds"]
            words += ", " + rules.speed_words(
                line, f"{rules.ratio(r)} the time {claim.peer_name} takes", r
            )
    if rules.is_num(line.get("epoch_ratio_max")) and not rules.busy(line):
        words += (
            f"; its slowest epoch {rules.ratio(line['epoch_ratio_max'])} the undisturbed "
            "run's median epoch"
        )
    brief += ("" if once else ", not every image once") + neighbours
    return Figure(what, ours, peer, words, brief)


def torch_time(claim: Claim, line: dict) -> Figure | None:
    """The torch engine's time to the target; when it never reached it, its best accuracy."""
    curve = line.get("torch_curve") or []
    if line.get("torch_seconds_to_target") is not None or not curve or not rules.is_num(*curve):
        return record.versus(claim, line)
    peer = rules.get(line, "numba_seconds_to_target")
    mb = f", mini-batch {line['torch_batch_size']}" if "torch_batch_size" in line else ""
    ours = f"not reached in {len(curve)} epochs (best {rules.pc(max(curve))}{mb})"
    return Figure(
        record.fill(claim.what, [line, record.DEFAULTS]),
        ours,
        f"the numba engine: {rules.num(peer)} s" if rules.is_num(peer) else "the numba engine: -",
        "the target was not reached",
        ours,
    )
