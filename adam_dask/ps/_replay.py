"""The pusher's side of "no acknowledged update lost": pushes kept until every copy holds them.

With ``ack="replay"`` (the default) a primary acknowledges a push as soon as it applied it, and
forwards it to the shard's other copies a little later, in batches. A primary that dies in
between would take the push with it; so the pusher keeps every acknowledged push, per shard,
until the primary reports it *confirmed*: held by every live copy of the shard. When the routing
names a new primary for a shard (fail-over, or a shard rebuilt from the checkpoint), the pusher
sends the pushes it still holds for that shard to the new primary again, with their original
push ids, so a push that did reach the surviving copies is recognised and applied once.

A primary is known by its address *and* the shard's generation: a worker that comes back under
the same address holds another lineage of the shard, and its word confirms nothing acknowledged
by the one before.

:class:`ReplayLog` is the bookkeeping, pure (no Dask, no I/O, no clocks); the client handle in
:mod:`adam_dask.ps.server` drives it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["HeldPush", "ReplayLog"]


@dataclass(slots=True)
class HeldPush:
    """One shard's part of an acknowledged push, kept until confirmed.

    ``method`` and ``payload`` rebuild the node call for this shard alone (``"push"`` with the
    shard's delta, or ``"push_outer"`` with the outer-product arguments); ``primary``, ``gen``
    and ``version`` say who acknowledged it, in which generation of the shard, at which of its
    versions. ``mark`` (what the push covers of its pusher's data) goes with every replay, so
    the new primary records it with the values.
    """

    push_id: int
    method: str
    payload: Any
    primary: str
    gen: int
    version: int
    nbytes: int
    mark: Any = None  # the push's data position (a Mark), replayed with it


class ReplayLog:
    """Acknowledged but unconfirmed pushes, by shard, oldest first."""

    def __init__(self) -> None:
        self._held: dict[int, OrderedDict[int, HeldPush]] = {}
        self.nbytes = 0
        self.replayed = 0

    def __len__(self) -> int:
        return sum(len(h) for h in self._held.values())

    def __bool__(self) -> bool:
        return any(self._held.values())

    def shards(self) -> list[int]:
        """The shards with held pushes."""
        return sorted(s for s, h in self._held.items() if h)

    def add(self, sid: int, held: HeldPush) -> None:
        """Keep ``held`` (a push acknowledged for shard ``sid``)."""
        per = self._held.setdefault(sid, OrderedDict())
        old = per.pop(held.push_id, None)
        if old is not None:
            self.nbytes -= old.nbytes
        per[held.push_id] = held
        self.nbytes += held.nbytes

    def acknowledged(self, sid: int, push_id: int, primary: str, gen: int, version: int) -> None:
        """A held push was (re)acknowledged by ``primary`` in generation ``gen`` at ``version``
        (after a replay)."""
        per = self._held.get(sid)
        held = per.get(push_id) if per is not None else None
        if held is not None:
            held.primary, held.gen, held.version = primary, int(gen), int(version)

    def confirm(self, sid: int, primary: str, gen: int, version: int) -> int:
        """``primary`` of generation ``gen`` reports every copy of ``sid`` holds its versions up
        to ``version``: drop the pushes it acknowledged at or below it. Returns how many were
        dropped."""
        per = self._held.get(sid)
        if not per:
            return 0
        drop = [
            p
            for p, h in per.items()
            if h.primary == primary and h.gen == gen and h.version <= version
        ]
        for p in drop:
            self.nbytes -= per.pop(p).nbytes
        return len(drop)

    def moved(self, primaries: dict[int, tuple[str, int]]) -> dict[int, list[HeldPush]]:
        """{sid: held pushes} acknowledged by another primary than the shard's now
        (``primaries``: {sid: (address, generation)}); these must be sent to the new one."""
        out: dict[int, list[HeldPush]] = {}
        for sid, per in self._held.items():
            now = primaries.get(sid)
            if now is None:
                continue
            stale = [h for h in per.values() if (h.primary, h.gen) != now]
            if stale:
                out[sid] = stale
        return out

    def held(self, sid: int) -> list[HeldPush]:
        """The pushes held for ``sid``, oldest first."""
        return list(self._held.get(sid, {}).values())

    def clear(self) -> None:
        self._held.clear()
        self.nbytes = 0
