"""The Adam page's data: one JSON-safe status dict built from what the scheduler knows.

Pure functions, no Dask and no I/O: :func:`build_status` takes the PS controller's routing,
the nodes' ``stats()``, the scheduler's events and the checkpoint histories, already fetched
(:mod:`adam_dask.dashboard._plugin` fetches them), and returns the dict served at
``/adam/status.json`` and rendered at ``/adam``. Every field read from outside is optional:
a missing or malformed field shows as ``None``, never as an error page.

>>> meter = RateMeter(window=10.0)
>>> meter.add("a", 0.0, 0), meter.add("a", 2.0, 100), meter.add("a", 4.0, 300)
(None, 50.0, 75.0)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from .._secrets import redact_url

__all__ = [
    "PROGRESS_TOPIC",
    "PS_TOPIC",
    "ROLES",
    "STATUS_VERSION",
    "RateMeter",
    "build_status",
    "training_runs",
]

STATUS_VERSION = 1
# The topics the producers log to: the PS controller (adam_dask.ps.placement, fail-over
# events) and the replica tasks (adam_dask.train.task, progress twice a second).
PS_TOPIC = "adam-ps"
PROGRESS_TOPIC = "adam-progress"
ROLES = ("PS", "DATA", "TRAIN")

# Figures copied from a node's stats() into its row, when present
_NODE_FIELDS = (
    "replication_lag",
    "writeback_lag_versions",
    "writeback_lag_seconds",
    "writeback_errors",
    "forward_errors",
)
# Per-epoch fields taken from a checkpoint history record
_HISTORY_FIELDS = ("loss", "test_accuracy", "images_per_second", "seconds", "images_applied")


def _num(x: Any) -> float | int | None:
    """``x`` as a finite JSON number, else None."""
    if isinstance(x, bool):
        return None
    if not isinstance(x, (int, float)):
        item = getattr(x, "item", None)  # numpy scalars
        x = item() if callable(item) else None
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class RateMeter:
    """Rates of growing counters over a sliding window of samples.

    ``add(key, t, count)`` records a sample and returns the counter's rate over the samples of
    the last ``window`` seconds (None until two samples exist). A counter that goes down (a
    node created anew) starts over.
    """

    def __init__(self, window: float):
        self.window = float(window)
        self._samples: dict[Hashable, deque[tuple[float, float]]] = {}

    def add(self, key: Hashable, t: float, count: float) -> float | None:
        q = self._samples.setdefault(key, deque())
        if q and count < q[-1][1]:
            q.clear()
        q.append((t, count))
        # keep one sample at or before the window's start, so the window is fully covered
        while len(q) > 2 and q[1][0] <= t - self.window:
            q.popleft()
        (t0, c0), (t1, c1) = q[0], q[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None

    def forget(self, keep: Iterable[Hashable]) -> None:
        """Drop the counters not in ``keep`` (nodes that are gone)."""
        keep = set(keep)
        for key in [k for k in self._samples if k not in keep]:
            del self._samples[key]


def _role(resources: Mapping[str, Any]) -> str | None:
    for role in ROLES:
        if resources.get(role):
            return role
    return None


def _server(
    sid: str,
    routing: Mapping[str, Any],
    stats: Mapping[str, Any],
    rates: Mapping[str, float | None],
    workers: Mapping[str, Mapping[str, Any]],
    story: Sequence[Mapping[str, Any]] = (),
    max_story: int = 12,
) -> dict:
    holders = [list(h) for h in routing.get("routing") or []]
    info = routing.get("info") or {}
    meta = info.get("meta") or {}
    nodes = sorted(set(routing.get("nodes") or {}) | {a for h in holders for a in h})
    rows = []
    for addr in nodes:
        st = stats.get(addr)
        err = st if isinstance(st, str) else None
        st = st if isinstance(st, Mapping) else {}
        row: dict[str, Any] = {
            "address": addr,
            "name": (workers.get(addr) or {}).get("name"),
            "host": (workers.get(addr) or {}).get("host"),
            "primaries": [s for s, h in enumerate(holders) if h and h[0] == addr],
            "backups": [s for s, h in enumerate(holders) if addr in h[1:]],
            "pushes": _num(st.get("pushes")),
            "pushes_per_second": _num(rates.get(addr)),
            "error": err,
        }
        row["copies"] = len(row["primaries"]) + len(row["backups"])
        if row["pushes_per_second"] is None:  # one sample so far: the average since start
            up, n = _num(st.get("uptime")), row["pushes"]
            row["pushes_per_second"] = n / up if up and n is not None else None
        row.update({k: _num(st.get(k)) for k in _NODE_FIELDS})
        rows.append(row)

    def total(key: str, fn: Any = sum) -> Any:
        vals = [r[key] for r in rows if r[key] is not None]
        return fn(vals) if vals else None

    versions: dict[str, dict[str, int]] = {}
    for addr in nodes:
        st = stats.get(addr)
        vs = st.get("versions") if isinstance(st, Mapping) else None
        if isinstance(vs, Mapping):
            for s, v in vs.items():
                if _num(v) is not None:
                    versions.setdefault(str(s), {})[addr] = int(v)
    return {
        "id": sid,
        "shards": len(holders),
        "copies": _num(routing.get("target")),
        "healthy": routing.get("healthy"),
        "generation": _num(routing.get("generation")),
        "pending": list(routing.get("pending") or []),
        "lost": list(routing.get("lost") or []),
        "heal_times": [t for t in map(_num, routing.get("heal_times") or []) if t is not None],
        # the URL only, without credentials (the routing carries no storage options)
        "checkpoint": redact_url(info["checkpoint"]) if info.get("checkpoint") else None,
        "optimizer": optimizer_label(info.get("optimizer")),
        "run": meta.get("run"),
        # the model replica's partition plan (Trainer(partitions=P > 1)), as the Trainer stored it
        "partition_plan": meta.get("partition_plan"),
        "placement": {str(s): h for s, h in enumerate(holders)},
        "nodes": rows,
        "shard_versions": versions,
        # the controller's newest events of note (ParameterServer.story), newest first
        "story": [dict(e) for e in list(story)[-max_story:][::-1]] if max_story > 0 else [],
        "totals": {
            "pushes": total("pushes"),
            "pushes_per_second": total("pushes_per_second"),
            "max_replication_lag": total("replication_lag", max),
            "writeback_lag_versions": total("writeback_lag_versions", max),
            "writeback_lag_seconds": total("writeback_lag_seconds", max),
            "writeback_errors": total("writeback_errors"),
        },
    }


def training_runs(
    progress: Iterable[tuple[float, Any]],
    histories: Mapping[str, list[dict] | None] | None = None,
) -> list[dict]:
    """Per run, per epoch: images, seconds and images/s from the replicas' progress events,
    joined with the loss and test accuracy of the run's checkpoint history (``histories``:
    ``{run: records}``). Runs in order of their first event."""
    runs: dict[str, dict[int, dict[int, dict]]] = {}
    first: dict[str, float] = {}
    for t, msg in progress:
        if not isinstance(msg, Mapping):
            continue
        run, epoch, replica = msg.get("run"), _num(msg.get("epoch")), _num(msg.get("replica"))
        if run is None or epoch is None or replica is None:
            continue
        first.setdefault(run, t)
        rep = runs.setdefault(run, {}).setdefault(int(epoch), {}).setdefault(int(replica), {})
        rep["images"] = max(rep.get("images", 0), _num(msg.get("images")) or 0)
        rep["seconds"] = max(rep.get("seconds", 0.0), _num(msg.get("seconds")) or 0.0)
        rep["final"] = rep.get("final", False) or bool(msg.get("final"))
    for run in histories or {}:
        first.setdefault(run, math.inf)
    out = []
    for run in sorted(first, key=lambda r: first[r]):
        epochs: dict[int, dict] = {}
        for e, reps in (runs.get(run) or {}).items():
            images = sum(r["images"] for r in reps.values())
            seconds = max(r["seconds"] for r in reps.values())
            epochs[e] = {
                "epoch": e,
                "images": images,
                "seconds": seconds,
                "images_per_second": images / seconds if seconds > 0 else None,
                "replicas": len(reps),
                "finished": all(r["final"] for r in reps.values()),
                "loss": None,
                "test_accuracy": None,
            }
        for rec in (histories or {}).get(run) or []:
            num = _num(rec.get("epoch")) if isinstance(rec, Mapping) else None
            if num is None:
                continue
            row = epochs.setdefault(
                int(num), {"epoch": int(num), "images": None, "replicas": None, "finished": True}
            )
            for k in _HISTORY_FIELDS:
                v = _num(rec.get(k))
                if v is not None or k not in row:
                    row[k] = v
        out.append({"run": run, "epochs": [epochs[e] for e in sorted(epochs)]})
    return out


def build_status(
    *,
    now: float,
    workers: Mapping[str, Mapping[str, Any]],
    servers: Mapping[str, Mapping[str, Any]],
    node_stats: Mapping[str, Mapping[str, Any]] | None = None,
    rates: Mapping[str, Mapping[str, float | None]] | None = None,
    progress: Iterable[tuple[float, Any]] = (),
    ps_events: Iterable[tuple[float, Any]] = (),
    histories: Mapping[str, list[dict] | None] | None = None,
    max_events: int = 20,
    stories: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict:
    """The status dict of the Adam page.

    Parameters
    ----------
    now : float
        Wall-clock time of the snapshot (seconds since the epoch).
    workers : {address: {"name", "host", "resources"}}
        The scheduler's workers.
    servers : {server id: routing}
        The PS controller's routing of each server (the ``adam_ps_routing`` handler's answer).
    node_stats : {server id: {address: stats dict, or an error string}}
        Each PS node's ``stats()``.
    rates : {server id: {address: shard updates per second}}
        From a :class:`RateMeter` over the nodes' ``pushes`` counters.
    progress, ps_events : iterable of (time, message)
        The scheduler's events on :data:`PROGRESS_TOPIC` and :data:`PS_TOPIC`.
    histories : {run id: records}
        Checkpoint histories (one record per epoch) of the runs that have one.
    max_events : int
        How many of the newest PS events to keep (and of each server's story).
    stories : {server id: entries}
        The controller's story of each server (the ``adam_ps_story`` handler's answer), oldest
        first: why its shards are where they are.
    """
    node_stats = node_stats or {}
    rates = rates or {}
    wrows = []
    for addr, w in workers.items():
        wrows.append(
            {
                "address": addr,
                "name": None if w.get("name") is None else str(w.get("name")),
                "host": w.get("host"),
                "role": _role(w.get("resources") or {}),
            }
        )
    order = {r: i for i, r in enumerate(ROLES)}
    wrows.sort(key=lambda r: (order.get(str(r["role"]), len(ROLES)), str(r["address"])))
    events = []
    for t, msg in list(ps_events)[-max_events:] if max_events > 0 else []:
        if isinstance(msg, Mapping):
            events.append({"time": _num(t), **{k: msg[k] for k in msg if k != "time"}})
    return {
        "version": STATUS_VERSION,
        "time": now,
        "workers": wrows,
        "servers": [
            _server(
                sid,
                servers[sid],
                node_stats.get(sid) or {},
                rates.get(sid) or {},
                workers,
                (stories or {}).get(sid) or (),
                max_events,
            )
            for sid in sorted(servers)
        ],
        "training": training_runs(progress, histories),
        "events": events[::-1],
    }


def optimizer_label(doc: Any) -> str:
    """The server optimizer in a few words: ``sum``, ``nesterov (lr 0.7, momentum 0.9)``,
    either ``+staleness``."""
    if not isinstance(doc, Mapping):
        return "sum"
    kind = str(doc.get("kind", "sum")) + ("+staleness" if doc.get("staleness") else "")
    if doc.get("kind") == "nesterov":
        kind += f" (lr {_num(doc.get('lr'))}, momentum {_num(doc.get('momentum'))})"
    return kind
