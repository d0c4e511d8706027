"""The parameter-server node's protocol as a pure state machine: no Dask, no I/O, no clocks.

A :class:`NodeState` holds the copies of shards one PS node keeps for one server: the primaries
it applies pushes to and the backups it keeps up to date. :meth:`NodeState.handle` takes an
event (:mod:`adam_dask.ps.protocol.messages`) and returns the actions to carry out; the actor
(:mod:`adam_dask.ps.runtime.node`) and the simulator (:mod:`adam_dask.testing.simulation`) do the I/O.

The rules:

* **Apply**: a primary applies a push to a shard when the pusher's stamp is the shard's current
  generation; otherwise the shard is reported ``moved`` and the pusher refreshes its routing.
* **Acknowledge**: with ``ack="replay"``/``"primary"`` at once, with the version every copy
  holds (``confirmed``) and the version that also the checkpoint holds (``durable``: a
  replaying pusher keeps its pushes until then); with ``ack="all"`` once every backup holds
  the push.
* **Forward**: each backup gets, one forward at a time, the newest values of every shard that
  changed since the position it last reported, with the push ids applied since (all of them
  when it holds another generation's values).
* **Fence**: generations only grow. A node refuses forwards stamped with a generation older
  than the one it knows, and answers with the newer one; a primary told of a newer generation
  of its shard (by a backup, the controller's answer to a write-back or a heartbeat) steps down
  and forgets the shard. A node the controller no longer counts as a member stops everything.
* **Write back**: a primary writes blocks of its dirty shards; the controller names a block in
  the manifest only when the writer's generation is current (:mod:`adam_dask.ps.protocol.controller`).

The controller's commands (assign, promote, restore, backup lists, flush) are
:class:`~adam_dask.ps.protocol.node_commands.Commands`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import ShardUnavailable, UpdateRejected
from .messages import (
    Action,
    AddBackups,
    Assign,
    Confirmed,
    Drop,
    Event,
    Fence,
    Flush,
    Forward,
    ForwardDone,
    ForwardDue,
    ForwardFailed,
    HeartbeatReply,
    Marks,
    Peer,
    Position,
    Promote,
    Pull,
    Pushes,
    Replicate,
    Reply,
    Restore,
    SetBackups,
    Versions,
    WriteBlocks,
    WriteDone,
    WriteDue,
    WriteFailed,
)
from .node_commands import NOT_HELD, Commands, _Waiter, command
from .shard import Mark, ShardState
from .story import Story, shards_of

logger = logging.getLogger(__name__)

__all__ = ["NOT_HELD", "NOT_MEMBER", "NodeState", "command"]

NOT_MEMBER = -2  # the controller's refusal of a write-back from a node it no longer counts
_NOWHERE: Position = (-1, -1)
STORY_IN_STATS = 16  # the newest entries of the node's story in its stats (all: story())


class NodeState(Commands):
    """The protocol state of one PS node (see the module doc).

    Parameters
    ----------
    addr : str
        The node's own address (in log messages and forwards).
    dedup_window : int, optional
        Push ids remembered per shard (``adam.ps.dedup-window``).
    checkpoint : bool
        Whether the server writes back to a checkpoint.
    """

    def __init__(self, addr: str, *, dedup_window: int | None = None, checkpoint: bool = False):
        self.addr = addr
        self.dedup_window = dedup_window
        self.checkpoint = checkpoint
        self.shards: dict[int, ShardState] = {}
        self.gens: dict[int, int] = {}  # the newest generation known per shard: the fence
        self.primaries: dict[int, list[Peer]] = {}  # sid -> its backups
        self.list_stamps: dict[int, int] = {}  # sid -> stamp of the backup list in force
        self.acked: dict[str, dict[int, Position]] = {}  # backup -> sid -> position it holds
        self.inflight: set[str] = set()  # backups with a forward on the way
        self.written: dict[int, int] = {}  # primaries: the version the manifest names
        self.writing = False
        self.writing_gens: dict[int, int] = {}  # the write-back on its way: its blocks' gens
        self.waiters: list[_Waiter] = []
        self.member = True
        self._cache: dict[int, tuple[Position, np.ndarray]] = {}
        self.pushes = 0
        self.floats_applied = 0
        self.floats_written = 0  # shard values written back to the checkpoint (primaries)
        self.refused_stale = 0
        self.forward_errors = 0
        self.writeback_errors = 0
        self.last_writeback_error: str | None = None
        self.stepped_down = 0
        self.story = Story(f"node-{addr}")

    def __repr__(self) -> str:
        backups = sorted(set(self.shards) - set(self.primaries))
        return f"NodeState({self.addr}, primaries={sorted(self.primaries)}, backups={backups})"

    # -- the one entry point ---------------------------------------------------------------------

    def handle(self, event: Event) -> list[Action]:
        """Apply ``event``; return the actions to carry out, in order. An event of note (every
        one but the data path's, which is recorded only when it changes the node's role) goes
        into the node's :attr:`story`."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"a PS node does not handle {type(event).__name__}")
        role = (len(self.shards), len(self.primaries), self.member)
        actions = handler(self, event)
        if type(event) not in _DATA_PATH or role != (
            len(self.shards),
            len(self.primaries),
            self.member,
        ):
            touched = shards_of(event).union(*(shards_of(a) for a in actions))
            self.story.record(self.story.stimulus(event), event, touched, actions)
        return actions

    def validate(self) -> None:
        """Raise :class:`AssertionError` when the node's invariants do not hold (the simulation
        calls it after every step): a primary holds its shard; no copy is ahead of the fence;
        the checkpoint never names a version a primary has not reached; a node that left holds
        nothing."""
        for sid in self.primaries:
            assert sid in self.shards, f"{self.addr}: primary of shard {sid} it does not hold"
        for sid, st in self.shards.items():
            fence = self.gens.get(sid)
            assert fence is not None and st.gen <= fence, (
                f"{self.addr}: shard {sid} at generation {st.gen} past the fence {fence}"
            )
        for sid, v in self.written.items():
            assert sid in self.primaries and v <= self.shards[sid].version, (
                f"{self.addr}: shard {sid} written at {v}, beyond what it holds"
            )
        assert self.member or not self.shards, f"{self.addr}: left the server, holds shards"

    # -- reading ---------------------------------------------------------------------------------

    def values_of(self, sid: int) -> tuple[Position, np.ndarray]:
        """(position, an immutable copy of the values), cached per position."""
        st = self.shards[sid]
        cached = self._cache.get(sid)
        if cached is None or cached[0] != st.position:
            cached = (st.position, st.values.copy())
            self._cache[sid] = cached
        return cached

    def confirmed(self, sid: int) -> int:
        """The newest version of primary ``sid`` every current backup holds."""
        st = self.shards[sid]
        out = st.version
        for addr, _ in self.primaries[sid]:
            gen, version = self.acked.get(addr, {}).get(sid, _NOWHERE)
            out = min(out, version if gen == st.gen else -1)
        return out

    def durable(self, sid: int) -> int:
        """The newest version of primary ``sid`` that outlives the loss of every copy: every
        current backup holds it and, with a checkpoint, the block the manifest names does too.
        A pusher keeps its pushes (``ack="replay"``) until they are durable."""
        out = self.confirmed(sid)
        if self.checkpoint:
            out = min(out, self.written.get(sid, -1))
        return out

    def heartbeat(self) -> dict[int, Position]:
        """What a heartbeat carries: the positions of the primaries."""
        return {s: self.shards[s].position for s in self.primaries}

    def accepts(self, sid: int, stamps: dict[int, int] | None) -> bool:
        """Whether a push or pull of ``sid`` stamped ``stamps`` may be served here."""
        if not self.member or sid not in self.primaries:
            return False
        if stamps is None or sid not in stamps:
            return True
        if int(stamps[sid]) != self.gens[sid]:
            self.refused_stale += 1
            return False
        return True

    # -- update path -----------------------------------------------------------------------------

    def _on_Pushes(self, ev: Pushes) -> list:
        out: list = []
        todo: dict[int, list[tuple[int, np.ndarray | None, int | None, Mark | None]]] = {}
        results = []
        for i, p in enumerate(ev.items):
            res: dict = {"per_shard": {}, "moved": [], "confirmed": {}, "gens": {}}
            checked: dict[int, np.ndarray | None] = {}
            try:
                for sid, d in p.deltas.items():
                    sid = int(sid)
                    if self.accepts(sid, p.stamps):
                        checked[sid] = self.shards[sid].check(d, scan=not p.scanned)
                    else:
                        res["moved"].append(sid)
            except UpdateRejected as exc:
                out.append(Reply(p.req, exc))
                continue
            for sid, d in checked.items():
                todo.setdefault(sid, []).append((i, d, p.push_id, p.mark))
            results.append((i, p, res))
        versions: dict[tuple[int, int], int] = {}
        for sid, items in todo.items():
            st = self.shards[sid]
            fenced = st.pushes_fenced
            applied = st.apply_batch(
                [d for _, d, _, _ in items],
                [pid for _, _, pid, _ in items],
                [m for _, _, _, m in items],
                checked=True,
            )
            n = len(items) - (st.pushes_fenced - fenced)
            self.pushes += n
            self.floats_applied += n * st.size
            for (i, _, _, _), v in zip(items, applied):
                versions[(i, sid)] = v
        urgent = False
        for i, p, res in results:
            for sid in p.deltas:
                if (i, int(sid)) in versions:
                    res["per_shard"][int(sid)] = versions[(i, int(sid))]
            if p.ack == "all" and res["per_shard"]:
                self.waiters.append(_Waiter(p.req, "push", dict(res["per_shard"]), res))
                urgent = True
            else:
                res["confirmed"] = {s: self.confirmed(s) for s in res["per_shard"]}
                res["durable"] = {s: self.durable(s) for s in res["per_shard"]}
                res["gens"] = {s: self.gens[s] for s in res["per_shard"]}
                out.append(Reply(p.req, res))
        if urgent:
            out += self._settle()
            out += self._forwards()
        return out

    def _on_Pull(self, ev: Pull) -> list:
        ok = [s for s in ev.sids if self.accepts(s, ev.stamps)]
        return [
            Reply(
                ev.req,
                {
                    "per_shard": {s: self.values_of(s)[1] for s in ok},
                    "moved": [s for s in ev.sids if s not in ok],
                },
            )
        ]

    def read_into(
        self, sids: list[int], stamps: dict[int, int] | None, dest: Any
    ) -> tuple[list[int], list[int]]:
        """Copy the values of the primaries among ``sids`` into ``dest(start, stop, i)`` (the
        place for ``sids[i]``, a float32 view): the data plane's pull, one copy, between two
        batches of pushes. Returns (the sids copied, the sids moved)."""
        ok, moved = [], []
        for i, s in enumerate(sids):
            if self.accepts(s, stamps):
                st = self.shards[s]
                np.copyto(dest(st.start, st.stop, i), st.values)
                ok.append(s)
            else:
                moved.append(s)
        return ok, moved

    def _on_Marks(self, ev: Marks) -> list:
        ok = [s for s in ev.sids if self.accepts(s, None)]
        return [
            Reply(
                ev.req,
                {
                    "per_shard": {s: self.shards[s].marks_of(ev.epoch) for s in ok},
                    "moved": [s for s in ev.sids if s not in ok],
                },
            )
        ]

    def _on_Confirmed(self, ev: Confirmed) -> list:
        ok = [s for s in ev.sids if self.accepts(s, None)]
        return [
            Reply(
                ev.req,
                {
                    "per_shard": {s: self.confirmed(s) for s in ok},
                    "durable": {s: self.durable(s) for s in ok},
                    "gens": {s: self.gens[s] for s in ok},
                    "moved": [s for s in ev.sids if s not in ok],
                },
            )
        ]

    def _on_Versions(self, ev: Versions) -> list:
        if ev.primaries_only:
            sids = list(self.primaries) if ev.sids is None else list(ev.sids)
            ok = [s for s in sids if self.accepts(s, None)]
            value: dict = {
                "per_shard": {s: self.shards[s].version for s in ok},
                "moved": [s for s in sids if s not in ok],
            }
        else:
            sids = list(self.shards) if ev.sids is None else [s for s in ev.sids]
            value = {s: self.shards[s].version for s in sids if s in self.shards}
        return [Reply(ev.req, value)]

    # -- replication -----------------------------------------------------------------------------

    def _on_ForwardDue(self, ev: ForwardDue) -> list:
        return self._forwards()

    def _forwards(self, only: set[str] | None = None) -> list:
        """A forward to every idle backup that is behind on some shard."""
        if not self.member:
            return []
        per_backup: dict[str, list] = {}
        keys: dict[str, str] = {}
        for sid, peers in self.primaries.items():
            st = self.shards[sid]
            for addr, key in peers:
                if addr in self.inflight or (only is not None and addr not in only):
                    continue
                held = self.acked.get(addr, {}).get(sid, _NOWHERE)
                if held >= st.position:
                    continue
                since = held[1] if held[0] == st.gen else -1
                per_backup.setdefault(addr, []).append(st.snapshot(since, self.values_of(sid)[1]))
                keys[addr] = key
        out = []
        for addr, snaps in per_backup.items():
            self.inflight.add(addr)
            out.append(Forward(addr, keys[addr], tuple(snaps)))
        return out

    def _on_ForwardDone(self, ev: ForwardDone) -> list:
        self.inflight.discard(ev.backup)
        acked = self.acked.setdefault(ev.backup, {})
        for sid, pos in ev.held.items():
            if ev.backup in self._backups_of(sid):
                gen, version = pos  # a list if it came over the network
                acked[sid] = max(acked.get(sid, _NOWHERE), (gen, version))
        for sid, gen in ev.refused.items():
            if sid in self.primaries and gen > self.gens[sid]:
                self._step_down(sid, gen, f"backup {ev.backup} knows generation {gen}")
        out = self._settle()
        if any(ev.backup in b for w in self.waiters for b in self._waited_backups(w)):
            out += self._forwards({ev.backup})
        return out

    def _on_ForwardFailed(self, ev: ForwardFailed) -> list:
        self.inflight.discard(ev.backup)
        self.forward_errors += 1
        return []

    def _on_Replicate(self, ev: Replicate) -> list:
        held: dict[int, Position] = {}
        refused: dict[int, int] = {}
        for snap in ev.snaps:
            sid = snap.shard
            st = self.shards.get(sid)
            known = self.gens.get(sid, NOT_HELD)
            if st is None or not self.member:
                refused[sid] = NOT_HELD
                continue
            if snap.gen < known or (sid in self.primaries and snap.gen == known):
                refused[sid] = known
                self.refused_stale += 1
                logger.info(
                    "node %s: refused a forward of shard %d from %s (generation %d, I know %d)",
                    self.addr,
                    sid,
                    ev.sender,
                    snap.gen,
                    known,
                )
                continue
            if sid in self.primaries:  # a newer primary exists: this one is a backup now
                self._step_down(sid, snap.gen, f"{ev.sender} forwards generation {snap.gen}")
            self.gens[sid] = max(known, snap.gen)
            st.install(
                snap.version, snap.values, snap.ids, gen=snap.gen, full=snap.full, marks=snap.marks
            )
            held[sid] = st.position
        return [Reply(ev.req, {"held": held, "refused": refused}), *self._settle()]

    # -- write-back ------------------------------------------------------------------------------

    def _on_WriteDue(self, ev: WriteDue) -> list:
        if not self.checkpoint or self.writing or not self.member:
            return []
        dirty = [s for s in self.primaries if self.shards[s].version > self.written.get(s, -1)]
        if not dirty:
            return []
        self.writing = True
        self.writing_gens = {s: self.shards[s].gen for s in dirty}
        return [
            WriteBlocks(tuple(self.shards[s].snapshot(-1, self.values_of(s)[1]) for s in dirty))
        ]

    def _on_WriteDone(self, ev: WriteDone) -> list:
        self.writing = False
        wrote, self.writing_gens = self.writing_gens, {}
        for sid, version in ev.accepted.items():
            if sid in self.primaries:
                self.written[sid] = max(self.written.get(sid, -1), int(version))
                self.floats_written += self.shards[sid].stop - self.shards[sid].start
        for sid, gen in ev.refused.items():
            if gen == NOT_MEMBER:
                self._retire("the controller refused a write-back")
            elif sid in self.primaries:
                if self._deposed_by(gen, sid, wrote.get(sid)):
                    self._step_down(sid, gen, "the controller refused its write-back")
                else:
                    logger.info(
                        "node %s: the controller refused a block of shard %d of generation %s; "
                        "still its primary at generation %d",
                        self.addr,
                        sid,
                        wrote.get(sid),
                        self.gens[sid],
                    )
        return self._settle()

    def _deposed_by(self, gen: int, sid: int, wrote: int | None) -> bool:
        """Whether the refusal of a block of primary ``sid`` written at generation ``wrote``,
        naming generation ``gen``, means another primary: a newer generation than this node
        knows, or this node's own generation when the block was of it too (the controller
        does not count this node as that generation's primary). A block of an older
        generation proves nothing about the newer one: the node may have been fenced and
        promoted again since it wrote it (its promotion's answer lost), and the generation
        the refusal names, that of the controller's round then, may be its own now. A node
        that stepped down on it would be named by the routing as the primary and refuse
        every push and every new backup for good."""
        if gen > self.gens[sid]:
            return True
        return gen == self.gens[sid] and wrote == gen

    def _on_WriteFailed(self, ev: WriteFailed) -> list:
        self.writing = False
        self.writeback_errors += 1
        self.last_writeback_error = ev.error
        return []

    # -- membership and fencing ------------------------------------------------------------------

    def _on_HeartbeatReply(self, ev: HeartbeatReply) -> list:
        if not ev.member:
            if self.member:
                self._retire("the controller no longer counts this node")
            return self._settle()
        for sid, gen in ev.gens.items():
            if gen > self.gens.get(sid, NOT_HELD):
                if sid in self.primaries:
                    self._step_down(sid, gen, "the controller knows a newer generation")
                elif sid in self.shards:
                    self.gens[sid] = gen
        return self._settle()

    def _on_Fence(self, ev: Fence) -> list:
        positions = {}
        for sid, gen in ev.gens.items():
            if sid not in self.shards:
                continue
            if sid in self.primaries and gen > self.gens[sid]:
                self._step_down(sid, gen, "fenced by the controller")
            self.gens[sid] = max(self.gens[sid], gen)
            positions[sid] = self.shards[sid].position
        return [Reply(ev.req, positions), *self._settle()]

    def _step_down(self, sid: int, gen: int, why: str) -> None:
        """A newer generation of primary ``sid`` exists: stop applying, forwarding and writing
        it back; keep the values as a plain copy (the controller decides what they are worth:
        a fenced copy may still be the newest)."""
        logger.warning("node %s: no longer the primary of shard %d (%s)", self.addr, sid, why)
        self.stepped_down += 1
        self.gens[sid] = max(self.gens.get(sid, NOT_HELD), gen)
        self.primaries.pop(sid, None)
        self.written.pop(sid, None)
        for acked in self.acked.values():
            acked.pop(sid, None)

    def _retire(self, why: str) -> None:
        logger.warning("node %s: stops serving (%s)", self.addr, why)
        self.member = False
        for sid in list(self.shards):
            self._forget(sid)

    def _forget(self, sid: int) -> None:
        self.shards.pop(sid, None)
        self.primaries.pop(sid, None)
        self.written.pop(sid, None)
        self._cache.pop(sid, None)
        for acked in self.acked.values():
            acked.pop(sid, None)

    # -- waiters ---------------------------------------------------------------------------------

    def _backups_of(self, sid: int) -> set[str]:
        return {a for a, _ in self.primaries.get(sid, [])}

    def _waited_backups(self, w: _Waiter) -> list[set[str]]:
        if w.kind == "add":
            return list(w.backups.values())
        return [self._backups_of(s) for s in w.need]

    def _settle(self) -> list:
        """Answer the waiters whose conditions hold now (or can never hold here)."""
        out, keep = [], []
        for w in self.waiters:
            reply = self._check(w)
            if reply is None:
                keep.append(w)
            else:
                out.append(Reply(w.req, reply))
        self.waiters = keep
        return out

    def _check(self, w: _Waiter) -> Any:
        for sid in list(w.need):
            if sid in self.primaries:
                continue
            if w.kind == "add":
                return ShardUnavailable(f"node {self.addr} is no longer the primary of {sid}")
            del w.need[sid]
            w.value["per_shard"].pop(sid, None)
            w.value["moved"].append(sid)
        for sid, version in w.need.items():
            st = self.shards[sid]
            if w.kind == "add":
                for addr in w.backups[sid]:
                    if addr not in self._backups_of(sid):
                        return ShardUnavailable(f"backup {addr} of shard {sid} was removed")
                    if self.acked.get(addr, {}).get(sid, _NOWHERE) < (st.gen, version):
                        return None
            elif self.confirmed(sid) < version:
                return None
            if w.written and self.written.get(sid, -1) < version:
                return None
        if w.kind == "push":
            w.value["confirmed"] = {s: self.confirmed(s) for s in w.value["per_shard"]}
            w.value["gens"] = {s: self.gens[s] for s in w.value["per_shard"]}
        if w.kind in ("push", "flush"):  # a flush of the copies alone leaves pushes to hold
            w.value["durable"] = {s: self.durable(s) for s in w.value["per_shard"]}
        if w.kind == "add":
            return {s: v for s, v in w.need.items()}
        return w.value

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters and lags of this node (see ParameterServer.stats)."""
        lag = 0
        for sid in self.primaries:
            lag = max(lag, self.shards[sid].version - self.confirmed(sid))
        wb = 0  # without a checkpoint nothing is written back, so nothing lags behind
        if self.checkpoint:
            wb = max(
                (self.shards[s].version - self.written.get(s, -1) for s in self.primaries),
                default=0,
            )
        return {
            "primaries": sorted(self.primaries),
            "backups": sorted(set(self.shards) - set(self.primaries)),
            "member": self.member,
            "pushes": self.pushes,
            "pushes_fenced": sum(st.pushes_fenced for st in self.shards.values()),
            "floats_applied": self.floats_applied,
            "floats_written": self.floats_written,
            "replication_lag": int(lag),
            "writeback_lag_versions": int(max(wb, 0)),
            "writeback_errors": self.writeback_errors,
            "last_writeback_error": self.last_writeback_error,
            "forward_errors": self.forward_errors,
            "refused_stale": self.refused_stale,
            "stepped_down": self.stepped_down,
            "versions": {s: st.version for s, st in self.shards.items()},
            "generations": {s: st.gen for s, st in self.shards.items()},
            "story": [e.to_dict() for e in self.story()[-STORY_IN_STATS:]],
        }


_Handler = Callable[[NodeState, Any], list[Action]]

# what a node does with each event: mypy checks every handler exists and takes its event
_HANDLERS: dict[type[Event], _Handler] = {
    Pushes: NodeState._on_Pushes,
    Pull: NodeState._on_Pull,
    Confirmed: NodeState._on_Confirmed,
    Marks: NodeState._on_Marks,
    Versions: NodeState._on_Versions,
    ForwardDue: NodeState._on_ForwardDue,
    ForwardDone: NodeState._on_ForwardDone,
    ForwardFailed: NodeState._on_ForwardFailed,
    Replicate: NodeState._on_Replicate,
    WriteDue: NodeState._on_WriteDue,
    WriteDone: NodeState._on_WriteDone,
    WriteFailed: NodeState._on_WriteFailed,
    HeartbeatReply: NodeState._on_HeartbeatReply,
    Fence: NodeState._on_Fence,
    Assign: NodeState._on_Assign,
    Promote: NodeState._on_Promote,
    Restore: NodeState._on_Restore,
    SetBackups: NodeState._on_SetBackups,
    AddBackups: NodeState._on_AddBackups,
    Drop: NodeState._on_Drop,
    Flush: NodeState._on_Flush,
}

# the data path's events: in the story only when they change the node's role
_DATA_PATH: frozenset[type[Event]] = frozenset(
    {
        Pushes,
        Pull,
        Confirmed,
        Marks,
        Versions,
        ForwardDue,
        ForwardDone,
        Replicate,
        WriteDue,
        WriteDone,
        HeartbeatReply,
    }
)
