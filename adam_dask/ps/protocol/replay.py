"""The pusher's side of "no acknowledged update lost": pushes kept until they are durable.

With ``ack="replay"`` (the default) a primary acknowledges a push as soon as it applied it, and
forwards it to the shard's other copies a little later, in batches, and writes it back to the
checkpoint later still. A primary that dies before forwarding would take the push with it, and
every copy dying before the write-back would too; so the pusher keeps every acknowledged push,
per shard, until the primary reports it *durable*: held by every live copy of the shard and,
when the server has a checkpoint, by the block the manifest names. When the routing names a new
primary for a shard (fail-over, or a shard rebuilt from the checkpoint), the pusher sends the
pushes it still holds for that shard to the new primary again, with their original push ids
and marks, so a push the survivors or the checkpoint already hold is recognised and applied once.

A push every copy holds is marked *replicated* while it waits for the write-back; over the byte
budget (a storage outage holding the write-back up), replicated pushes are let go first
(:meth:`ReplayLog.shed`): three copies still hold them, and only the loss of all three at once
could take them; a push whose shard moved since is never let go of (its copies may be the
ones lost), it is replayed.

A primary is known by its address *and* the shard's generation: a worker that comes back under
the same address holds another lineage of the shard, and its word confirms nothing acknowledged
by the one before.

:class:`ReplayLog` is the bookkeeping, pure (no Dask, no I/O, no clocks): it takes the
primaries' answers (:meth:`ReplayLog.answered`) and says which requests replay the moved pushes
(:meth:`ReplayLog.replays`, :meth:`ReplayLog.next_replay`) and which asks what every copy holds
(:meth:`ReplayLog.question`). What a pusher does with it, and when, is the plan's
(:mod:`~adam_dask.ps.protocol.courier_plan`), carried out by the client's
:class:`~adam_dask.ps.client.courier.Courier` and by the simulation's pushers
(:mod:`adam_dask.testing.simulation`), each with its own transport and clock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .replies import ConfirmedReply, NodeReply, PushReply
from .request import Request

logger = logging.getLogger(__name__)

__all__ = ["HeldPush", "ReplayLog", "replay_request"]


@dataclass(slots=True)
class HeldPush:
    """One shard's part of an acknowledged push, kept until durable.

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
    replicated: bool = False  # every copy holds it: it waits for the checkpoint alone
    lease: Any = None  # the data plane's segment ``payload`` is a view of (released on drop)

    def drop(self) -> int:
        """Let go of the payload; returns its bytes."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        return self.nbytes


class ReplayLog:
    """Acknowledged pushes not yet durable, by shard, oldest first. Thread-safe: the data
    plane adds from the pushing thread, the settler confirms on the event loop."""

    def __init__(self) -> None:
        self._held: dict[int, OrderedDict[int, HeldPush]] = {}
        # shards whose held pushes all come from one primary and generation, at rising versions
        # (the steady state): confirming walks only what it drops or marks, and nothing moved
        self._ordered: set[int] = set()
        self.nbytes = 0
        self.replayed = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(h) for h in self._held.values())

    def __bool__(self) -> bool:
        with self._lock:
            return any(self._held.values())

    def shards(self) -> list[int]:
        """The shards with held pushes."""
        with self._lock:
            return sorted(s for s, h in self._held.items() if h)

    def add(self, sid: int, held: HeldPush) -> None:
        """Keep ``held`` (a push acknowledged for shard ``sid``)."""
        with self._lock:
            per = self._held.setdefault(sid, OrderedDict())
            old = per.pop(held.push_id, None)
            if old is not None:
                self.nbytes -= old.drop()
            if not per:
                self._ordered.add(sid)
            elif sid in self._ordered:
                last = next(reversed(per.values()))
                if (last.primary, last.gen) != (held.primary, held.gen) or (
                    last.version >= held.version
                ):
                    self._ordered.discard(sid)
            per[held.push_id] = held
            self.nbytes += held.nbytes

    def acknowledged(self, sid: int, push_id: int, primary: str, gen: int, version: int) -> None:
        """A held push was (re)acknowledged by ``primary`` in generation ``gen`` at ``version``
        (after a replay)."""
        with self._lock:
            self._acknowledged(sid, push_id, primary, gen, version)

    def _acknowledged(self, sid: int, push_id: int, primary: str, gen: int, version: int) -> None:
        per = self._held.get(sid)
        held = per.get(push_id) if per is not None else None
        if per is not None and held is not None:
            if len(per) > 1:  # a replayed push takes a new version where it stands
                self._ordered.discard(sid)
            held.primary, held.gen, held.version = primary, int(gen), int(version)
            held.replicated = False  # the new primary's copies have yet to say so

    @property
    def unreplicated(self) -> int:
        """How many held pushes some copy may still lack."""
        with self._lock:
            return sum(not h.replicated for per in self._held.values() for h in per.values())

    def confirm(
        self, sid: int, primary: str, gen: int, version: int, durable: int | None = None
    ) -> int:
        """``primary`` of generation ``gen`` reports every copy of ``sid`` holds its versions up
        to ``version`` and the checkpoint up to ``durable`` (``None``: as far as ``version``, a
        server without a checkpoint or a flush, which waits for both). Drop the pushes it
        acknowledged at or below ``durable``, mark those at or below ``version`` replicated.
        Returns how many were dropped."""
        with self._lock:
            return self._confirm(sid, primary, gen, version, durable)

    def _confirm(self, sid: int, primary: str, gen: int, version: int, durable: int | None) -> int:
        per = self._held.get(sid)
        if not per:
            return 0
        durable = int(version) if durable is None else min(int(durable), int(version))
        if sid in self._ordered:
            return self._confirm_ordered(per, primary, gen, version, durable)
        drop = []
        for p, h in per.items():
            if h.primary != primary or h.gen != gen:
                continue
            if h.version <= durable:
                drop.append(p)
            elif h.version <= version:
                h.replicated = True
        for p in drop:
            self.nbytes -= per.pop(p).drop()
        if not per or self._in_order(per):
            self._ordered.add(sid)
        return len(drop)

    def _confirm_ordered(
        self, per: OrderedDict[int, HeldPush], primary: str, gen: int, version: int, durable: int
    ) -> int:
        """:meth:`_confirm` of a shard held in order: drop from the oldest while durable, mark
        replicated on while every copy holds it, stop at the first newer push."""
        first = next(iter(per.values()))
        if (first.primary, first.gen) != (primary, gen):
            return 0
        dropped = 0
        while per:
            h = next(iter(per.values()))
            if h.version > durable:
                break
            self.nbytes -= per.popitem(last=False)[1].drop()
            dropped += 1
        for h in per.values():
            if h.version > version:
                break
            h.replicated = True
        return dropped

    @staticmethod
    def _in_order(per: OrderedDict[int, HeldPush]) -> bool:
        items = iter(per.values())
        prev = next(items)
        for h in items:
            if (h.primary, h.gen) != (prev.primary, prev.gen) or h.version <= prev.version:
                return False
            prev = h
        return True

    def shed(self, below: int, primaries: dict[int, tuple[str, int]] | None = None) -> int:
        """Let go of replicated pushes, each shard's oldest first, until the held ones take at
        most ``below`` bytes (or none replicated is left). With ``primaries`` (the routing's,
        {sid: (address, generation)}) only those the shard's primary now acknowledged: the
        copies that held a push whose shard moved may all be gone (a shard rebuilt from the
        checkpoint lacks it), so it is replayed, not let go of. Returns how many went."""
        with self._lock:
            return self._shed(below, primaries)

    def _shed(self, below: int, primaries: dict[int, tuple[str, int]] | None) -> int:
        gone = 0
        for sid, per in self._held.items():
            now = None if primaries is None else primaries.get(sid)
            for p in [
                p
                for p, h in per.items()
                if h.replicated and (primaries is None or (h.primary, h.gen) == now)
            ]:
                if self.nbytes <= below:
                    return gone
                self.nbytes -= per.pop(p).drop()
                gone += 1
        return gone

    def moved(self, primaries: dict[int, tuple[str, int]]) -> dict[int, list[HeldPush]]:
        """{sid: held pushes} acknowledged by another primary than the shard's now
        (``primaries``: {sid: (address, generation)}); these must be sent to the new one."""
        with self._lock:
            return self._moved(primaries)

    def _moved(self, primaries: dict[int, tuple[str, int]]) -> dict[int, list[HeldPush]]:
        out: dict[int, list[HeldPush]] = {}
        for sid, per in self._held.items():
            now = primaries.get(sid)
            if now is None or not per:
                continue
            if sid in self._ordered:  # one primary holds them all: moved all or none
                first = next(iter(per.values()))
                if (first.primary, first.gen) != now:
                    out[sid] = list(per.values())
                continue
            stale = [h for h in per.values() if (h.primary, h.gen) != now]
            if stale:
                out[sid] = stale
        return out

    def answered(
        self, req: Request, addr: str, reply: NodeReply, hold: Callable[[int, int, int], HeldPush]
    ) -> None:
        """Take the answer ``reply`` of the primary at ``addr`` to ``req``: keep what it
        acknowledged of a push (``ack="replay"``; ``hold(sid, gen, version)`` makes the shard's
        :class:`HeldPush`), or, for a replay, note the primary that holds it now; then drop the
        pushes it says are durable and mark replicated those every copy holds."""
        if req.op == "push":
            assert isinstance(reply, PushReply), reply
            if req.ack == "replay":
                replay = req.args.get("replay")
                for sid, version in reply.per_shard.items():
                    sid, gen = int(sid), int((reply.gens or {})[sid])
                    if replay is not None:
                        self.acknowledged(sid, req.push_id, addr, gen, int(version))
                        self.replayed += 1
                    else:
                        self.add(sid, hold(sid, gen, int(version)))
            self.confirm_reply(addr, reply.confirmed or {}, reply.durable, reply.gens)
        elif req.op in ("confirmed", "flush"):
            assert isinstance(reply, ConfirmedReply), reply
            self.confirm_reply(addr, reply.per_shard, reply.durable, reply.gens)

    def confirm_reply(
        self,
        addr: str,
        confirmed: dict[int, int],
        durable: dict[int, int] | None,
        gens: dict[int, int] | None,
    ) -> None:
        """Drop the held pushes a primary's answer says are durable, and mark replicated those
        it says every copy holds (``confirmed``: {sid: version}; ``durable``: {sid: version
        the checkpoint holds too}; ``gens`` the answering primary's generations)."""
        for sid, version in confirmed.items():
            d = None if durable is None else int(durable.get(sid, -1))
            self.confirm(int(sid), addr, int((gens or {})[sid]), int(version), d)

    def replays(
        self, primaries: dict[int, tuple[str, int]], shards: list[tuple[int, int]]
    ) -> list[Request]:
        """The requests that send the held pushes of shards whose primary changed
        (``primaries``: the routing's, {sid: (address, generation)}) to the new primary, one
        per push and shard, with the push's id and mark (``shards``: {sid: (start, stop)})."""
        return [
            replay_request(h, sid, shards[sid])
            for sid, items in self.moved(primaries).items()
            for h in items
        ]

    def next_replay(
        self, primaries: dict[int, tuple[str, int]], shards: list[tuple[int, int]]
    ) -> Request | None:
        """The first of :meth:`replays` (None: no held push moved), the others not made: a
        pusher sends one at a time and asks again after each answer."""
        with self._lock:
            for sid, per in self._held.items():
                now = primaries.get(sid)
                if now is None:
                    continue
                for h in per.values():
                    if (h.primary, h.gen) != now:
                        return replay_request(h, sid, shards[sid])
                    if sid in self._ordered:  # one primary holds them all: moved all or none
                        break
        return None

    def question(self, urgent: bool = False) -> Request | None:
        """The request that asks the primaries of the shards with held pushes what every copy
        and the checkpoint hold (None: nothing held); ``urgent``: they forward at once."""
        sids = tuple(self.shards())
        return Request("confirmed", sids, urgent=urgent) if sids else None

    def held(self, sid: int) -> list[HeldPush]:
        """The pushes held for ``sid``, oldest first."""
        with self._lock:
            return list(self._held.get(sid, {}).values())

    def clear(self) -> None:
        with self._lock:
            for per in self._held.values():
                for h in per.values():
                    h.drop()
            self._held.clear()
            self._ordered.clear()
            self.nbytes = 0


def replay_request(h: HeldPush, sid: int, shard: tuple[int, int]) -> Request:
    """The request that sends the held push ``h`` of shard ``sid`` (``shard``: its start and
    stop) again: its id, its mark, its values or the offload's arguments."""
    req = Request("push", (sid,), h.push_id, "replay", h.mark, args={"replay": True})
    if h.method == "push_outer":
        req.outer = h.payload
    elif h.payload is None:
        req.values, req.base, req.nonzero = np.zeros(0, np.float32), shard[0], {sid: False}
    else:
        req.values, req.base = h.payload, shard[0]
    return req
