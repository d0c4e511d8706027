"""The controller's commands to a PS node (a mixin of
:class:`~adam_dask.ps.protocol.node_state.NodeState`, pure like it): hold shards, become a primary
(promoted, or rebuilt from the checkpoint), change backup lists, forget shards, flush.

Commands that arrive twice or late change nothing: a promotion or restore of a generation in
force is answered again, and backup lists carry a stamp (the controller's call id, which only
grows), so an older list never replaces a newer one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ShardUnavailable, UpdateRejected
from .messages import (
    AddBackups,
    Assign,
    Cancel,
    Drop,
    Fence,
    Flush,
    Peer,
    Promote,
    Reply,
    Restore,
    SetBackups,
    WriteDue,
)
from .shard import ShardState

logger = logging.getLogger(__name__)

__all__ = ["NOT_HELD", "Commands", "command"]  # _Waiter: NodeState's too

NOT_HELD = -1  # a refusal's generation when the node does not hold the shard


def command(method: str, req: Any, args: tuple) -> Any:
    """The event of a controller's call ``method(*args)`` to a node (``restore`` excepted: its
    block is read from storage first)."""
    if method == "fence":
        return Fence(req, *args)
    if method == "promote":
        return Promote(req, *args)
    if method == "assign":
        return Assign(req, *args)
    if method == "add_backups":
        return AddBackups(req, *args)
    if method == "set_backups":
        return SetBackups(req, *args)
    raise ValueError(f"no PS node command {method!r}")


@dataclass
class _Waiter:
    """A request answered once copies (and the checkpoint) hold versions of primaries."""

    req: Any
    kind: str  # "push", "flush" or "add"
    need: dict[int, int]  # sid -> version
    value: dict
    written: bool = False
    backups: dict[int, set[str]] = field(default_factory=dict)  # "add": only these backups


class Commands:
    """The controller's commands of NodeState."""

    addr: str
    dedup_window: int | None
    checkpoint: bool
    member: bool
    shards: dict[int, ShardState]
    gens: dict[int, int]
    primaries: dict[int, list[Peer]]
    list_stamps: dict[int, int]
    acked: dict[str, dict[int, tuple[int, int]]]
    inflight: set[str]
    written: dict[int, int]
    waiters: list
    _cache: dict

    def _settle(self) -> list:  # pragma: no cover - NodeState's
        raise NotImplementedError

    def _forwards(self, only: set[str] | None = None) -> list:  # pragma: no cover
        raise NotImplementedError

    def _step_down(self, sid: int, gen: int, why: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def _forget(self, sid: int) -> None:  # pragma: no cover - NodeState's
        raise NotImplementedError

    def _backups_of(self, sid: int) -> set[str]:  # pragma: no cover - NodeState's
        raise NotImplementedError

    def confirmed(self, sid: int) -> int:  # pragma: no cover - NodeState's
        raise NotImplementedError

    def accepts(self, sid: int, stamps: dict[int, int] | None) -> bool:  # pragma: no cover
        raise NotImplementedError

    def _on_WriteDue(self, ev: WriteDue) -> list:  # pragma: no cover - NodeState's
        raise NotImplementedError

    def _on_Assign(self, ev: Assign) -> list:
        for sid, (start, stop) in ev.shards.items():
            gen = int(ev.gens[sid])
            if gen < self.gens.get(sid, NOT_HELD):
                continue
            if sid in self.primaries and sid not in ev.primaries and self.gens[sid] < gen:
                self._step_down(sid, gen, "assigned as a backup of a newer generation")
            if sid not in self.shards:
                self.shards[sid] = ShardState(
                    sid, start, stop, None, ev.version, self.dedup_window, gen=gen
                )
            self.gens[sid] = gen
        for sid, peers in ev.primaries.items():
            if sid in self.shards:
                self.primaries[sid] = [tuple(p) for p in peers]  # type: ignore[misc]
                self.written[sid] = self.shards[sid].version
        return [Reply(ev.req, None)]

    def load(
        self,
        values: dict[int, np.ndarray],
        versions: dict[int, int],
        marks: dict[int, Any] | None = None,
    ) -> None:
        """Initial values of held shards (a new or restored server): already in the checkpoint;
        ``marks`` {sid: [Mark]}: the data positions they hold."""
        marks = {int(s): list(m) for s, m in (marks or {}).items()}
        for sid, v in values.items():
            st = self.shards[int(sid)]
            arr = np.asarray(v, dtype=np.float32).reshape(-1)
            if arr.shape[0] != st.size:
                raise UpdateRejected(
                    f"shard {sid}: {arr.shape[0]} values for {st.size} floats", shard=int(sid)
                )
            st.values[:] = arr
            st.version = int(versions[sid])
            st.set_marks(marks.get(int(sid), ()))
            self._cache.pop(int(sid), None)
            if int(sid) in self.primaries:
                self.written[int(sid)] = st.version
            for acked in self.acked.values():
                acked.pop(int(sid), None)

    def _on_Promote(self, ev: Promote) -> list:
        done: dict[int, int] = {}
        for sid, (gen, peers) in ev.shards.items():
            st = self.shards.get(sid)
            if st is None or not self.member or gen < self.gens.get(sid, NOT_HELD):
                continue
            if sid in self.primaries and st.gen == gen:  # the same promotion again
                done[sid] = st.version
                continue
            self.gens[sid] = gen
            st.gen = gen
            self.primaries[sid] = [tuple(p) for p in peers]  # type: ignore[misc]
            self.list_stamps[sid] = max(self.list_stamps.get(sid, 0), ev.stamp)
            self.written[sid] = -1  # the checkpoint holds another generation: write ours
            self._cache.pop(sid, None)
            for acked in self.acked.values():
                acked.pop(sid, None)
            done[sid] = st.version
            logger.info(
                "node %s: primary of shard %d at generation %d, version %d",
                self.addr,
                sid,
                gen,
                st.version,
            )
        return [Reply(ev.req, done), *self._forwards()]

    def _on_Restore(self, ev: Restore) -> list:
        if not self.member or ev.gen < self.gens.get(ev.sid, NOT_HELD):
            return [Reply(ev.req, ShardUnavailable(f"shard {ev.sid}: stale restore"))]
        held = self.shards.get(ev.sid)
        if held is not None and ev.sid in self.primaries and held.gen == ev.gen:
            return [Reply(ev.req, ev.version)]  # the same restore again: done already
        st = ShardState(ev.sid, ev.start, ev.stop, None, -1, self.dedup_window, gen=-1)
        st.install(ev.version, ev.values, ev.ids, gen=ev.gen, full=True, marks=ev.marks)
        self._forget(ev.sid)
        self.shards[ev.sid] = st
        self.gens[ev.sid] = ev.gen
        self.primaries[ev.sid] = []
        self.written[ev.sid] = ev.version
        logger.warning(
            "node %s: shard %d rebuilt from the checkpoint at version %d (generation %d)",
            self.addr,
            ev.sid,
            ev.version,
            ev.gen,
        )
        return [Reply(ev.req, ev.version)]

    def _on_SetBackups(self, ev: SetBackups) -> list:
        return [Reply(ev.req, None), *self._set_backups(ev.shards, ev.stamp), *self._settle()]

    def _set_backups(self, shards: dict[int, list[Peer]], stamp: int) -> list:
        """Make ``shards`` {sid: peers} the backup lists of those primaries, unless a list of a
        later stamp is in force already (a command that arrives late)."""
        out: list = []
        replaced: set[str] = set()
        for sid, peers in shards.items():
            if sid not in self.primaries or stamp < self.list_stamps.get(sid, 0):
                continue
            self.list_stamps[sid] = stamp
            new = [tuple(p) for p in peers]
            before = dict(self.primaries[sid])
            gone = set(before) - {a for a, _ in new}
            # another node on a backup's worker (the old one was lost and its worker came back):
            # what the old one held, and the answer to a forward on its way to it, say nothing
            # of the new one, which starts empty
            replaced |= {a for a, k in new if a in before and before[a] != k}
            self.primaries[sid] = new  # type: ignore[assignment]
            for addr in gone:
                self.acked.get(addr, {}).pop(sid, None)
        for addr in replaced:
            self.acked.pop(addr, None)
        wanted = {a for peers in self.primaries.values() for a, _ in peers}
        for addr in sorted((self.inflight - wanted) | (self.inflight & replaced)):
            self.inflight.discard(addr)
            out.append(Cancel(addr=addr))
        for addr in list(self.acked):
            if addr not in wanted:
                del self.acked[addr]
        return out

    def _on_AddBackups(self, ev: AddBackups) -> list:
        """Make ``shards`` {sid: peers} the backup lists; answer once the backups new to a list
        hold the shard's current position."""
        need, backups = {}, {}
        for sid, peers in ev.shards.items():
            if sid not in self.primaries:
                return [Reply(ev.req, ShardUnavailable(f"not the primary of shard {sid}"))]
            if ev.stamp < self.list_stamps.get(sid, 0):
                return [
                    Reply(ev.req, ShardUnavailable(f"a later backup list of {sid} is in force"))
                ]
            need[sid] = self.shards[sid].version
            backups[sid] = {a for a, _ in peers} - self._backups_of(sid)
        out = self._set_backups(ev.shards, ev.stamp)
        self.waiters.append(_Waiter(ev.req, "add", need, {}, backups=backups))
        return [*out, *self._forwards(), *self._settle()]

    def _on_Drop(self, ev: Drop) -> list:
        for sid in ev.sids:
            self._forget(sid)
        return [Reply(ev.req, None), *self._settle()]

    def _on_Flush(self, ev: Flush) -> list:
        sids = list(self.primaries) if ev.sids is None else list(ev.sids)
        ok = [s for s in sids if self.accepts(s, None)]
        target = {s: self.shards[s].version for s in ok}
        value = {
            "per_shard": dict(target),
            "gens": {s: self.gens[s] for s in ok},
            "moved": [s for s in sids if s not in ok],
        }
        written = ev.checkpoint and self.checkpoint
        self.waiters.append(_Waiter(ev.req, "flush", target, value, written=written))
        out = self._settle() + self._forwards()
        if written:
            out += self._on_WriteDue(WriteDue())
        return out

    def abandon_flush(self, req: Any) -> str | None:
        """Forget the flush ``req`` (its caller gave up waiting). Returns what it still waited
        for: ``"copies"`` (a backup lacks a version), ``"checkpoint"`` (the write-back alone),
        or None (no such flush: it was answered)."""
        for i, w in enumerate(self.waiters):
            if w.kind == "flush" and w.req is req:
                del self.waiters[i]
                behind = any(
                    s in self.primaries and self.confirmed(s) < v for s, v in w.need.items()
                )
                return "copies" if behind else "checkpoint"
        return None
