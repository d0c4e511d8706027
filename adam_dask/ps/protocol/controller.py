"""The parameter-server controller as a pure state machine: no Dask, no I/O; time comes in
with the events. Three modules by responsibility, none a mixin of another: this one (what the
controller knows, and its answers to membership, heartbeats, write-backs and the manifest),
:mod:`.repair` (what to call on which node so every shard has its primary and copies again)
and :mod:`.controller_machine` (dispatch by the event's type, the story).

One :class:`ServerState` per parameter server holds the routing (``{shard: [primary,
backups...]}``), the generation of every shard, the nodes and their heartbeats, and the
checkpoint's manifest. :func:`.controller_machine.handle` takes an event
(:mod:`adam_dask.ps.protocol.messages`) and returns actions; the scheduler plugin
(:mod:`adam_dask.ps.runtime.plugin`) and the simulator carry them out.

Decisions (each change of the routing bumps ``generation``):

* **Liveness**: a node whose heartbeats stop for ``heartbeat_timeout`` is declared dead: taken
  out of every shard at once, like a worker that left. Its worker is retired when it stays
  silent for ``retire_timeout``; a worker that speaks again in between (the node was only
  slow) is told its node is no member any more and may host a new node. While most nodes are
  silent at once the controller suspects itself (its own link cut, a stall): it declares none
  dead and, for up to ``DOUBT_RETIRE_TIMEOUTS`` retire timeouts, retires none, and a node's
  silence during that spell does not count toward ``retire_timeout``.
* **Promote**: a shard whose primary is gone gets a new generation; every surviving copy is
  fenced with it (it refuses the old primary from then on) and reports its position; the newest
  becomes primary. Only then does the routing name it, so nobody pushes to it before the old
  primary is fenced out.
* **Restore**: a shard with no copy left is rebuilt from its block in the checkpoint on a live
  node, at a new generation; the updates after that block are lost, at least as many as the
  heartbeats had reported (logged, counted in ``restored``).
* **Copies**: a shard with fewer than ``target`` copies gets one on a host it does not use.
* **Manifest**: the controller is its only writer. A write-back is named only when its writer
  is the shard's primary of the current generation; positions ``(generation, version)`` and the
  sequence number never go back, and a block is deleted only when two written manifests and
  ``block_grace`` seconds have passed since the last one naming it.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .manifest import Manifest
from .messages import (
    Beat,
    Cancel,
    LogEvent,
    NodeFailed,
    NodeReady,
    Position,
    Reply,
    Retire,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)
from .replies import BeatReply
from .story import Story

logger = logging.getLogger(__name__)

#: how many retire timeouts the controller doubts itself (most nodes silent at once: its own
#: link cut?) before retiring the silent anyway (frozen or dead for that long, they are gone)
DOUBT_RETIRE_TIMEOUTS = 3

__all__ = ["ServerState"]


@dataclass
class Op:
    """A call to a node the controller waits for."""

    op: int
    kind: str  # fence, promote, restore, assign, add, set_backups
    addr: str
    sids: tuple[int, ...]
    involves: frozenset[str]
    data: Any = None


@dataclass
class Round:
    """The fencing of one shard's surviving copies before a promotion."""

    gen: int
    waiting: set[str]
    asked: set[str]
    replies: dict[str, Position]


class ServerState:
    """The controller's state for one parameter server (see the module doc); the repair
    (promotion, restore, copies) is in :mod:`~adam_dask.ps.protocol.repair`.

    ``manifest`` is the checkpoint's manifest as written when the server was made (None: no
    checkpoint); ``workers`` the live PS workers {addr: host}; ``nodes`` {addr: actor key}.
    """

    def __init__(
        self,
        server_id: str,
        shards: list[tuple[int, int]],
        *,
        target: int,
        routing: dict[int, list[str]],
        nodes: dict[str, str],
        workers: dict[str, str],
        gens: dict[int, int],
        generation: int,
        manifest: dict | None,
        now: float,
        heartbeat_timeout: float,
        retire_timeout: float,
        retry_base: float,
        retry_max: float,
        block_grace: float,
    ):
        self.server_id = server_id
        self.shards = [(a, b) for a, b in shards]
        self.target = int(target)
        self.routing = {int(s): list(h) for s, h in routing.items()}
        self.nodes = dict(nodes)
        self.workers = dict(workers)
        self.gens = {int(s): int(g) for s, g in gens.items()}
        self.generation = int(generation)
        self.manifest = None if manifest is None else Manifest(manifest, grace=block_grace)
        self.now = now
        self.timeout = float(heartbeat_timeout)
        self.retire_timeout = float(retire_timeout)
        self.retry_base, self.retry_max = float(retry_base), float(retry_max)
        self.beats = {a: now for a in self.nodes}
        self.dead: set[str] = set()
        self.suspects: dict[str, float] = {}  # declared dead by heartbeats: since when
        self.retired: set[str] = set()  # workers this controller asked Dask to remove
        self.creating: set[str] = set()
        self.needs_primary: set[int] = set()
        self.rounds: dict[int, Round] = {}
        self.restoring: set[int] = set()
        self.lost: set[int] = set()
        self.backups_changed: set[int] = set()
        self.busy: dict[int, int] = {}
        self.ops: dict[int, Op] = {}
        self.retry_at: dict[Any, float] = {}
        self.failures: Counter = Counter()
        self.last_seen: dict[int, Position] = {}
        self.restored: list[dict] = []
        self.story = Story(f"controller-{server_id}")
        self.heal_started: float | None = None
        self.heal_times: list[float] = []
        self.declared_dead = 0
        self.beat_gap_max = 0.0  # the longest silence between two heartbeats of a member
        self.refused_writes = 0
        self.op_ids = itertools.count(1)
        self._last_tick: float | None = None
        self._stalled = False  # declaring held back: most nodes silent (logged once)
        self._doubted = False  # retiring held back: most nodes silent
        self._doubt_since: float | None = None  # when the current such spell began
        self._trusted_since = float("-inf")  # when the last such spell ended

    def validate(self) -> None:
        """Raise :class:`AssertionError` when the controller's invariants do not hold (the
        simulation calls it after every step): a shard's copies are on distinct workers, and a busy shard waits on a call the controller made."""
        for sid, holders in self.routing.items():
            assert len(set(holders)) == len(holders), f"shard {sid}: a worker holds two copies"
            assert 0 <= sid < len(self.shards), f"a copy of shard {sid}, which does not exist"
        for sid, op in self.busy.items():
            assert op in self.ops, f"shard {sid} waits on call {op}, which is not under way"

    def live(self) -> dict[str, str]:
        """{addr: host} of the PS workers that may hold copies."""
        return {a: h for a, h in self.workers.items() if a not in self.dead}

    def pending(self) -> set[int]:
        """Shards without a primary to push to right now: waiting for one, fencing their
        copies, being promoted (the routing already lacks the lost primary, the new one does
        not know yet), restoring, or lost."""
        promoting = {s for op in self.ops.values() if op.kind == "promote" for s in op.sids}
        return self.needs_primary | set(self.rounds) | promoting | self.restoring | self.lost

    def healthy(self) -> bool:
        """Every shard has its primary and ``target`` copies, and no repair is under way."""
        # not self.pending(), without building the set (the simulation asks after every step)
        if self.needs_primary or self.rounds or self.restoring or self.lost:
            return False
        if any(op.kind == "promote" for op in self.ops.values()):
            return False
        return all(len(h) >= self.target and h[0] in self.nodes for h in self.routing.values())

    def routing_info(self) -> dict:
        """What clients read: see ``ParameterServer.routing_info``."""
        return {
            "routing": [list(self.routing[s]) for s in range(len(self.shards))],
            "gens": [self.gens[s] for s in range(len(self.shards))],
            "nodes": dict(self.nodes),
            "pending": sorted(self.pending() - self.lost),
            "lost": sorted(self.lost),
            "target": self.target,
            "healthy": self.healthy(),
            "generation": self.generation,
            "heal_times": list(self.heal_times),
            "restored": list(self.restored),
            "declared_dead": self.declared_dead,
            "heartbeat_gap_max": round(self.beat_gap_max, 3),
            "refused_writes": self.refused_writes,
            "manifest_errors": self.manifest.errors if self.manifest else 0,
            "manifest_failing": self.manifest.failing if self.manifest else 0,
            "last_manifest_error": self.manifest.last_error if self.manifest else None,
        }

    def on_worker_added(self, ev: WorkerAdded) -> list:
        self.now = max(self.now, ev.now)
        self.workers[ev.addr] = ev.host
        return []

    def on_worker_removed(self, ev: WorkerRemoved) -> list:
        self.now = max(self.now, ev.now)
        self.workers.pop(ev.addr, None)
        self.suspects.pop(ev.addr, None)
        return self.lose(ev.addr, "its worker left the cluster")

    def on_beat(self, ev: Beat) -> list:
        self.now = max(self.now, ev.now)
        if self.nodes.get(ev.addr) != ev.key and ev.addr in self.creating:
            # a node starting there: its first beat can overtake the answer to its start (the
            # NodeReady that names its key). "No member" would retire it for good while the
            # controller goes on to count it and place copies on it, which it then refuses.
            # The answer without generations is the one a lost reply leaves: nothing changes.
            return [Reply(ev.req, BeatReply(True, {}))]
        if self.nodes.get(ev.addr) != ev.key:
            if self.suspects.pop(ev.addr, None) is not None:
                # the worker lives: its old node is out for good, the worker may host a new one
                self.dead.discard(ev.addr)
                logger.warning(
                    "server %s: PS node %s speaks again after it was declared dead; it is no "
                    "member any more, its worker may host a new node",
                    self.server_id,
                    ev.addr,
                )
            return [Reply(ev.req, BeatReply(False, {}))]
        self.beat_gap_max = max(self.beat_gap_max, ev.now - self.beats[ev.addr])
        self.beats[ev.addr] = ev.now
        for sid, pos in ev.positions.items():
            if self.routing.get(sid, [])[:1] == [ev.addr]:
                gen, version = pos  # a list if it came over the network
                self.last_seen[sid] = max(self.last_seen.get(sid, (-1, -1)), (gen, version))
        gens = {s: self.gens[s] for s, h in self.routing.items() if ev.addr in h}
        return [Reply(ev.req, BeatReply(True, gens))]

    def on_tick(self, ev: Tick) -> list:
        now = ev.now
        if self._last_tick is not None and now - self._last_tick > self.timeout / 2:
            lag = now - self._last_tick  # the controller itself stalled: nobody is to blame
            for a in self.beats:
                self.beats[a] += lag
        self._last_tick = self.now = max(self.now, now)
        out: list = []
        for addr in self._to_declare(now):
            self.declared_dead += 1
            logger.warning(
                "server %s: PS node %s missed its heartbeats for %.1fs: declared dead",
                self.server_id,
                addr,
                now - self.beats[addr],
            )
            out += self.lose(addr, "it missed its heartbeats")
            self.suspects[addr] = now
        for addr in self._to_retire(now):
            self.retired.add(addr)
            out.append(Retire(addr))
        return out

    def _to_retire(self, now: float) -> list[str]:
        """The workers to ask Dask to remove: those of nodes silent for ``retire_timeout`` and
        of nodes declared dead that long ago. None while most nodes are silent at once (the
        controller suspects itself: the scheduler cut from every worker would otherwise retire
        them all; after the cut heals, the nodes come back one by one, each as its connection
        recovers from TCP's back-off), and silence during such a spell does not count: after
        it, a node has ``retire_timeout`` from its end to speak again. The doubt has a limit,
        ``DOUBT_RETIRE_TIMEOUTS`` x ``retire_timeout``: most nodes silent that long are gone
        (frozen or dead, not behind a cut), and are retired, the way they heal, rather than
        left to Dask's worker timeout (minutes)."""
        if self._most_silent(now):
            if self._doubt_since is None:
                self._doubt_since = now
            if now - self._doubt_since <= DOUBT_RETIRE_TIMEOUTS * self.retire_timeout:
                self._doubted = True
                return []
        else:
            self._doubt_since = None
            if self._doubted:
                self._doubted = False
                self._trusted_since = now
        since_trust = self._trusted_since

        def overdue(t: float) -> bool:
            return now - max(t, since_trust) > self.retire_timeout

        silent = [a for a in self.nodes if overdue(self.beats.get(a, now))]
        for addr, since in list(self.suspects.items()):
            if overdue(since):
                del self.suspects[addr]
                silent.append(addr)
        return [a for a in sorted(set(silent) - self.retired) if a in self.workers]

    def _most_silent(self, now: float) -> bool:
        """Whether more than half of the nodes missed their heartbeats (``heartbeat_timeout``)."""
        overdue = sum(now - self.beats.get(a, now) > self.timeout for a in self.nodes)
        return 2 * overdue > len(self.nodes)

    def _to_declare(self, now: float) -> list[str]:
        """The silent nodes to declare dead now. Not when most nodes are silent at once (a
        stall of the machine, a compiler or the controller is likelier than that many
        failures), and never the last live copy of a shard: such nodes wait for Dask to lose
        their worker, or for ``retire_timeout``."""
        overdue = [a for a in sorted(self.nodes) if now - self.beats.get(a, now) > self.timeout]
        if not overdue:
            return []
        if self._most_silent(now):
            if not self._stalled:
                logger.warning(
                    "server %s: %d of %d PS nodes are silent at once; waiting before declaring "
                    "any dead",
                    self.server_id,
                    len(overdue),
                    len(self.nodes),
                )
            self._stalled = True
            return []
        self._stalled = False
        declare: list[str] = []
        for addr in overdue:
            gone = set(overdue) | set(declare)
            if all(
                any(a in self.nodes and a not in gone for a in holders)
                for holders in self.routing.values()
                if addr in holders
            ):
                declare.append(addr)
        return declare

    def lose(self, addr: str, why: str) -> list:
        """Take ``addr`` out of the server: routing, fence rounds, calls in flight."""
        was_node = self.nodes.pop(addr, None) is not None
        self.beats.pop(addr, None)
        self.dead.add(addr)
        self.creating.discard(addr)
        touched, primaries = [], []
        for sid, holders in self.routing.items():
            if addr not in holders:
                continue
            touched.append(sid)
            if holders[0] == addr and sid not in self.rounds:
                primaries.append(sid)
                self.needs_primary.add(sid)
            holders.remove(addr)
            if sid not in self.needs_primary:
                self.backups_changed.add(sid)
        for rnd in self.rounds.values():
            rnd.waiting.discard(addr)
            rnd.replies.pop(addr, None)
        out: list = []
        for op in list(self.ops.values()):
            if addr in op.involves:
                out += self.drop_op(op)
        if not touched and not was_node:
            return out
        self.generation += 1
        if self.heal_started is None:
            self.heal_started = self.now
        logger.warning(
            "server %s: PS node %s lost (%s): %d copies, %d primaries; repairing",
            self.server_id,
            addr,
            why,
            len(touched),
            len(primaries),
        )
        out.append(
            LogEvent(
                {
                    "event": "worker-lost",
                    "server": self.server_id,
                    "worker": addr,
                    "why": why,
                    "shards": touched,
                    "primaries": primaries,
                    "generation": self.generation,
                }
            )
        )
        return out

    def on_node_ready(self, ev: NodeReady) -> list:
        self.now = max(self.now, ev.now)
        self.creating.discard(ev.addr)
        if ev.addr in self.dead or ev.addr not in self.workers:
            return []
        self.nodes[ev.addr] = ev.key
        self.beats[ev.addr] = ev.now
        return []

    def on_node_failed(self, ev: NodeFailed) -> list:
        self.creating.discard(ev.addr)
        self.backoff(("node", ev.addr))
        logger.warning("server %s: no PS node on %s (%s)", self.server_id, ev.addr, ev.error)
        return []

    def backoff(self, key: Any) -> None:
        self.failures[key] += 1
        delay = min(self.retry_base * 2 ** (self.failures[key] - 1), self.retry_max)
        self.retry_at[key] = self.now + delay

    def ready(self, key: Any) -> bool:
        return self.retry_at.get(key, float("-inf")) <= self.now

    def drop_op(self, op: Op) -> list:
        self.ops.pop(op.op, None)
        for sid in op.sids:
            if self.busy.get(sid) == op.op:
                del self.busy[sid]
        if op.kind == "fence":
            for sid in op.sids:
                if sid in self.rounds:
                    self.rounds[sid].asked.discard(op.addr)
        elif op.kind == "promote":
            self.needs_primary.update(op.sids)
        elif op.kind == "restore":
            self.restoring.update(op.sids)
        elif op.kind == "set_backups":
            self.backups_changed.update(op.sids)
        return [Cancel(op=op.op)]
