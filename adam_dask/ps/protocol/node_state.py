"""The parameter-server node's protocol as a pure state machine: no Dask, no I/O, no clocks.

A :class:`NodeState` holds the copies of shards one PS node keeps for one server: the primaries
it applies pushes to and the backups it keeps up to date. :func:`.node_machine.handle` takes an
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

The node is three modules by responsibility, none a mixin of another:

* this one, :class:`NodeState`: what a node holds (shards, fences, backup lists, what each
  backup acknowledged, waiting requests) and what follows from it (what every copy holds, what
  is durable, whether a push may be served, answering waiting requests, stepping down);
* :mod:`.node_data`: the data path, replication and write-back (pushes, pulls, forwards to and
  from backups, fences, heartbeats' answers), as functions of a ``NodeState`` and an event;
* :mod:`.node_commands`: the controller's commands (assign, promote, restore, backup lists,
  drop, flush), the same way;

and :mod:`.node_machine` dispatches an event to its handler by its type and keeps the story.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ShardUnavailable, UpdateRejected
from .messages import Action, Peer, Position, Reply
from .optimizer import ServerOptimizer
from .replies import ConfirmedReply, PushReply
from .shard import ShardState
from .story import Story

logger = logging.getLogger(__name__)

__all__ = ["NOT_HELD", "NOT_MEMBER", "NOWHERE", "RESEND", "NodeState", "Waiter"]

NOT_HELD = -1  # a refusal's generation when the node does not hold the shard
NOT_MEMBER = -2  # the controller's refusal of a write-back from a node it no longer counts
RESEND = -3  # a backup's refusal of a copy whose push ids start past what it holds
NOWHERE: Position = (-1, -1)
STORY_IN_STATS = 16  # the newest entries of the node's story in its stats (all: story())


@dataclass
class Waiter:
    """A request answered once copies (and the checkpoint) hold versions of primaries: its
    answer (:class:`PushReply`, :class:`ConfirmedReply`, ``{sid: version}``) is made then."""

    req: Any
    kind: str  # "push", "flush" or "add"
    need: dict[int, int]  # sid -> version (a push's or flush's answer's ``per_shard``)
    moved: list[int] = field(default_factory=list)  # the answer's ``moved``
    gens: dict[int, int] = field(default_factory=dict)  # "flush": the answer's, when asked
    written: bool = False
    backups: dict[int, set[str]] = field(default_factory=dict)  # "add": only these backups


class NodeState:
    """What one PS node holds for one server, and what follows from it (see the module doc).

    Parameters
    ----------
    addr : str
        The node's own address (in log messages and forwards).
    dedup_window : int, optional
        Push ids remembered per shard (``adam.ps.dedup-window``).
    checkpoint : bool
        Whether the server writes back to a checkpoint.
    optimizer : ServerOptimizer, optional
        What the shards it holds do with each push (the sum by default).
    """

    def __init__(
        self,
        addr: str,
        *,
        dedup_window: int | None = None,
        checkpoint: bool = False,
        optimizer: ServerOptimizer | None = None,
    ):
        self.addr = addr
        self.dedup_window = dedup_window
        self.optimizer = optimizer if optimizer is not None else ServerOptimizer()
        self.checkpoint = checkpoint
        self.shards: dict[int, ShardState] = {}
        self.gens: dict[int, int] = {}  # the newest generation known per shard: the fence
        self.primaries: dict[int, list[Peer]] = {}  # sid -> its backups
        self.list_stamps: dict[int, int] = {}  # sid -> stamp of the backup list in force
        self.acked: dict[str, dict[int, Position]] = {}  # backup -> sid -> position it holds
        # sid -> backups an add listed that have not answered a forward of it since: no copies
        # yet (a copy of that add, or a retry, finds them listed and still waits for them)
        self.adding: dict[int, set[str]] = {}
        self.inflight: set[str] = set()  # backups with a forward on the way
        self.written: dict[int, int] = {}  # primaries: the version the manifest names
        self.writing = False
        self.writing_gens: dict[int, int] = {}  # the write-back on its way: its blocks' gens
        self.waiters: list[Waiter] = []
        self.member = True
        self.value_cache: dict[int, tuple[Position, np.ndarray]] = {}
        self.pushes = 0
        self.pushes_with_bases = 0  # naming the versions their pusher read (the staleness)
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

    def values_of(self, sid: int) -> tuple[Position, np.ndarray]:
        """(position, an immutable copy of the values), cached per position."""
        st = self.shards[sid]
        cached = self.value_cache.get(sid)
        if cached is None or cached[0] != st.position:
            cached = (st.position, st.values.copy())
            self.value_cache[sid] = cached
        return cached

    def confirmed(self, sid: int) -> int:
        """The newest version of primary ``sid`` every current backup holds."""
        st = self.shards[sid]
        out = st.version
        for addr, _ in self.primaries[sid]:
            gen, version = self.acked.get(addr, {}).get(sid, NOWHERE)
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

    def read_into(
        self,
        sids: list[int],
        stamps: dict[int, int] | None,
        dest: Any,
        versions: dict[int, int] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Copy the values of the primaries among ``sids`` into ``dest(start, stop, i)`` (the
        place for ``sids[i]``, a float32 view): the data plane's pull, one copy, between two
        batches of pushes. Returns (the sids copied, the sids moved); ``versions`` (when
        given) gets the version of each copied shard."""
        ok, moved = [], []
        for i, s in enumerate(sids):
            if self.accepts(s, stamps):
                st = self.shards[s]
                np.copyto(dest(st.start, st.stop, i), st.values)
                ok.append(s)
                if versions is not None:
                    versions[s] = st.version
            else:
                moved.append(s)
        return ok, moved

    def load(
        self,
        values: dict[int, np.ndarray],
        versions: dict[int, int],
        marks: dict[int, Any] | None = None,
        states: dict[int, np.ndarray] | None = None,
    ) -> None:
        """Initial values of held shards (a new or restored server): already in the checkpoint;
        ``marks`` {sid: [Mark]}: the data positions they hold; ``states`` {sid: momentum}: the
        optimizer's state they were written with (zeros where none)."""
        states = {int(s): v for s, v in (states or {}).items()}
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
            st.set_state(states.get(int(sid)))
            self.value_cache.pop(int(sid), None)
            if int(sid) in self.primaries:
                self.written[int(sid)] = st.version
            for acked in self.acked.values():
                acked.pop(int(sid), None)

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

    def step_down(self, sid: int, gen: int, why: str) -> None:
        """A newer generation of primary ``sid`` exists: stop applying, forwarding and writing
        it back; keep the values as a plain copy (the controller decides what they are worth:
        a fenced copy may still be the newest)."""
        logger.warning("node %s: no longer the primary of shard %d (%s)", self.addr, sid, why)
        self.stepped_down += 1
        self.gens[sid] = max(self.gens.get(sid, NOT_HELD), gen)
        self.primaries.pop(sid, None)
        self.adding.pop(sid, None)
        self.written.pop(sid, None)
        for acked in self.acked.values():
            acked.pop(sid, None)

    def retire(self, why: str) -> None:
        logger.warning("node %s: stops serving (%s)", self.addr, why)
        self.member = False
        for sid in list(self.shards):
            self.forget(sid)

    def forget(self, sid: int) -> None:
        self.shards.pop(sid, None)
        self.primaries.pop(sid, None)
        self.adding.pop(sid, None)
        self.written.pop(sid, None)
        self.value_cache.pop(sid, None)
        for acked in self.acked.values():
            acked.pop(sid, None)

    def backups_of(self, sid: int) -> set[str]:
        return {a for a, _ in self.primaries.get(sid, [])}

    def waited_backups(self, w: Waiter) -> list[set[str]]:
        if w.kind == "add":
            return list(w.backups.values())
        return [self.backups_of(s) for s in w.need]

    def settle(self) -> list[Action]:
        """Answer the waiters whose conditions hold now (or can never hold here)."""
        out: list[Action] = []
        keep = []
        for w in self.waiters:
            reply = self._check(w)
            if reply is None:
                keep.append(w)
            else:
                out.append(Reply(w.req, reply))
        self.waiters = keep
        return out

    def _check(
        self, w: Waiter
    ) -> PushReply | ConfirmedReply | dict[int, int] | ShardUnavailable | None:
        for sid in list(w.need):
            if sid in self.primaries:
                continue
            if w.kind == "add":
                return ShardUnavailable(f"node {self.addr} is no longer the primary of {sid}")
            del w.need[sid]
            w.moved.append(sid)
        for sid, version in w.need.items():
            st = self.shards[sid]
            if w.kind == "add":
                for addr in w.backups[sid]:
                    if addr not in self.backups_of(sid):
                        return ShardUnavailable(f"backup {addr} of shard {sid} was removed")
                    if self.acked.get(addr, {}).get(sid, NOWHERE) < (st.gen, version):
                        return None
            elif self.confirmed(sid) < version:
                return None
            if w.written and self.written.get(sid, -1) < version:
                return None
        if w.kind == "add":
            return {s: v for s, v in w.need.items()}
        # a flush of the copies alone leaves pushes to hold: durable says which
        durable = {s: self.durable(s) for s in w.need}
        if w.kind == "push":
            return PushReply(
                dict(w.need),
                tuple(w.moved),
                confirmed={s: self.confirmed(s) for s in w.need},
                durable=durable,
                gens={s: self.gens[s] for s in w.need},
            )
        return ConfirmedReply(dict(w.need), durable, w.gens, tuple(w.moved))

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
            "pushes_with_bases": self.pushes_with_bases,
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

    def validate(self) -> None:
        """Raise :class:`AssertionError` when the node's invariants do not hold (the simulation
        calls it after every step): a primary holds its shard; no copy is ahead of the fence;
        the checkpoint never names a version a primary has not reached. (A node that left may
        still take a late command's copy: it serves, forwards and writes back nothing.)"""
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
