"""The parameter-server controller as a pure state machine: no Dask, no I/O; time comes in
with the events.

One :class:`ServerState` per parameter server holds the routing (``{shard: [primary,
backups...]}``), the generation of every shard, the nodes and their heartbeats, and the
checkpoint's manifest. :meth:`ServerState.handle` takes an event
(:mod:`adam_dask.ps._messages`) and returns actions; the scheduler plugin
(:mod:`adam_dask.ps._plugin`) and the simulator carry them out.

Decisions (each change of the routing bumps ``generation``):

* **Liveness**: a node whose heartbeats stop for ``heartbeat_timeout`` is declared dead: taken
  out of every shard at once, like a worker that left. Its worker is retired when it stays
  silent for ``retire_timeout``; a worker that speaks again in between (the node was only
  slow) is told its node is no member any more and may host a new node.
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

from ._messages import (
    Beat,
    Call,
    CallDone,
    CallFailed,
    Cancel,
    Commit,
    CreateNode,
    DeleteBlocks,
    LogEvent,
    ManifestDone,
    ManifestFailed,
    NodeFailed,
    NodeReady,
    Position,
    Reply,
    Retire,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    WriteManifest,
    WriteReport,
)
from ._node_state import NOT_MEMBER
from .placement import choose_new_holder, choose_primary

logger = logging.getLogger(__name__)

__all__ = ["ServerState"]


@dataclass
class _Op:
    """A call to a node the controller waits for."""

    op: int
    kind: str  # fence, promote, restore, assign, add, set_backups
    addr: str
    sids: tuple[int, ...]
    involves: frozenset[str]
    data: Any = None


@dataclass
class _Round:
    """The fencing of one shard's surviving copies before a promotion."""

    gen: int
    waiting: set[str]
    asked: set[str]
    replies: dict[str, Position]


class ServerState:
    """The controller's state for one parameter server (see the module doc).

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
        self.shards = [tuple(s) for s in shards]
        self.target = int(target)
        self.routing = {int(s): list(h) for s, h in routing.items()}
        self.nodes = dict(nodes)
        self.workers = dict(workers)
        self.gens = {int(s): int(g) for s, g in gens.items()}
        self.generation = int(generation)
        self.manifest = None if manifest is None else dict(manifest)
        if self.manifest is not None:
            for k in ("versions", "generations", "blocks"):
                self.manifest[k] = list(self.manifest[k])
        self.now = now
        self.timeout = float(heartbeat_timeout)
        self.retire_timeout = float(retire_timeout)
        self.block_grace = float(block_grace)
        self.retry_base, self.retry_max = float(retry_base), float(retry_max)
        self.beats = {a: now for a in self.nodes}
        self.dead: set[str] = set()
        self.suspects: dict[str, float] = {}  # declared dead by heartbeats: since when
        self.retired: set[str] = set()  # workers this controller asked Dask to remove
        self.creating: set[str] = set()
        self.needs_primary: set[int] = set()
        self.rounds: dict[int, _Round] = {}
        self.restoring: set[int] = set()
        self.lost: set[int] = set()
        self.backups_changed: set[int] = set()
        self.busy: dict[int, int] = {}
        self.ops: dict[int, _Op] = {}
        self.retry_at: dict[Any, float] = {}
        self.failures: Counter = Counter()
        self.last_seen: dict[int, Position] = {}
        self.restored: list[dict] = []
        self.heal_started: float | None = None
        self.heal_times: list[float] = []
        self.declared_dead = 0
        self.refused_writes = 0
        self._ids = itertools.count(1)
        self._last_tick: float | None = None
        self._stalled = False
        # the manifest
        self.seq = int(manifest.get("sequence", 0)) if manifest else 0
        self.written_seq = self.seq
        self.manifest_dirty = False
        self.manifest_writing: int | None = None
        self.manifest_errors = 0
        self.last_manifest_error: str | None = None
        # (block path, first manifest sequence without it, when it was replaced)
        self.superseded: list[tuple[str, int, float]] = []
        self.commits: list[tuple[Any, int]] = []

    # -- the one entry point ---------------------------------------------------------------------

    def handle(self, event: Any) -> list:
        """Apply ``event``; return the actions to carry out, in order."""
        method = getattr(self, "_on_" + type(event).__name__, None)
        if method is None:
            raise TypeError(f"the PS controller does not handle {type(event).__name__}")
        out = method(event)
        return out + self._plan()

    # -- views -----------------------------------------------------------------------------------

    def live(self) -> dict[str, str]:
        """{addr: host} of the PS workers that may hold copies."""
        return {a: h for a, h in self.workers.items() if a not in self.dead}

    def pending(self) -> set[int]:
        """Shards without a primary to push to right now."""
        return self.needs_primary | set(self.rounds) | self.restoring | self.lost

    def healthy(self) -> bool:
        return not self.pending() and all(
            len(h) >= self.target and h[0] in self.nodes for h in self.routing.values()
        )

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
            "refused_writes": self.refused_writes,
            "manifest_errors": self.manifest_errors,
            "last_manifest_error": self.last_manifest_error,
        }

    # -- workers and heartbeats ------------------------------------------------------------------

    def _on_WorkerAdded(self, ev: WorkerAdded) -> list:
        self.now = max(self.now, ev.now)
        self.workers[ev.addr] = ev.host
        return []

    def _on_WorkerRemoved(self, ev: WorkerRemoved) -> list:
        self.now = max(self.now, ev.now)
        self.workers.pop(ev.addr, None)
        self.suspects.pop(ev.addr, None)
        return self._lose(ev.addr, "its worker left the cluster")

    def _on_Beat(self, ev: Beat) -> list:
        self.now = max(self.now, ev.now)
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
            return [Reply(ev.req, {"member": False, "gens": {}})]
        self.beats[ev.addr] = ev.now
        for sid, pos in ev.positions.items():
            if self.routing.get(sid, [])[:1] == [ev.addr]:
                self.last_seen[sid] = max(self.last_seen.get(sid, (-1, -1)), tuple(pos))  # type: ignore[arg-type]
        gens = {s: self.gens[s] for s, h in self.routing.items() if ev.addr in h}
        return [Reply(ev.req, {"member": True, "gens": gens})]

    def _on_Tick(self, ev: Tick) -> list:
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
            out += self._lose(addr, "it missed its heartbeats")
            self.suspects[addr] = now
        silent = [a for a in self.nodes if now - self.beats.get(a, now) > self.retire_timeout]
        for addr, since in list(self.suspects.items()):
            if now - since > self.retire_timeout:
                del self.suspects[addr]
                silent.append(addr)
        for addr in sorted(set(silent) - self.retired):
            if addr in self.workers:
                self.retired.add(addr)
                out.append(Retire(addr))
        return out

    def _to_declare(self, now: float) -> list[str]:
        """The silent nodes to declare dead now. Not when most nodes are silent at once (a
        stall of the machine, a compiler or the controller is likelier than that many
        failures), and never the last live copy of a shard: such nodes wait for Dask to lose
        their worker, or for ``retire_timeout``."""
        overdue = [a for a in sorted(self.nodes) if now - self.beats.get(a, now) > self.timeout]
        if not overdue:
            return []
        if 2 * len(overdue) > len(self.nodes):
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

    def _lose(self, addr: str, why: str) -> list:
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
                out += self._drop_op(op)
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

    def _drop_op(self, op: _Op) -> list:
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

    # -- node creation ---------------------------------------------------------------------------

    def _on_NodeReady(self, ev: NodeReady) -> list:
        self.now = max(self.now, ev.now)
        self.creating.discard(ev.addr)
        if ev.addr in self.dead or ev.addr not in self.workers:
            return []
        self.nodes[ev.addr] = ev.key
        self.beats[ev.addr] = ev.now
        return []

    def _on_NodeFailed(self, ev: NodeFailed) -> list:
        self.creating.discard(ev.addr)
        self._backoff(("node", ev.addr))
        logger.warning("server %s: no PS node on %s (%s)", self.server_id, ev.addr, ev.error)
        return []

    def _backoff(self, key: Any) -> None:
        self.failures[key] += 1
        delay = min(self.retry_base * 2 ** (self.failures[key] - 1), self.retry_max)
        self.retry_at[key] = self.now + delay

    def _ready(self, key: Any) -> bool:
        return self.retry_at.get(key, float("-inf")) <= self.now

    # -- calls -----------------------------------------------------------------------------------

    def _call(
        self, kind: str, addr: str, sids: list[int], method: str, args: tuple, **kw: Any
    ) -> Call:
        involves = frozenset(kw.pop("involves", ())) | {addr}
        op = _Op(next(self._ids), kind, addr, tuple(sids), involves, kw.pop("data", None))
        if method in ("promote", "set_backups", "add_backups"):
            args = (*args, op.op)  # the stamp that orders backup lists (op ids only grow)
        self.ops[op.op] = op
        if kind != "fence":
            for sid in sids:
                self.busy[sid] = op.op
        return Call(op.op, addr, self.nodes[addr], method, args)

    def _on_CallFailed(self, ev: CallFailed) -> list:
        op = self.ops.get(ev.op)
        if op is None:
            return []
        logger.warning("server %s: %s on %s failed: %s", self.server_id, op.kind, op.addr, ev.error)
        for sid in op.sids:
            self._backoff(("shard", sid))
        self._drop_op(op)  # the call is over: nothing to cancel
        return []

    def _on_CallDone(self, ev: CallDone) -> list:
        op = self.ops.pop(ev.op, None)
        if op is None:
            return []
        for sid in op.sids:
            if self.busy.get(sid) == op.op:
                del self.busy[sid]
            self.failures.pop(("shard", sid), None)
        handler = getattr(self, "_done_" + op.kind)
        return handler(op, ev.result)

    def _done_fence(self, op: _Op, result: dict) -> list:
        for sid in op.sids:
            rnd = self.rounds.get(sid)
            if rnd is None or rnd.gen != op.data[sid]:
                continue
            rnd.waiting.discard(op.addr)
            if sid in result:
                rnd.replies[op.addr] = tuple(result[sid])  # type: ignore[assignment]
            elif op.addr in self.routing[sid]:  # it does not hold the shard after all
                self.routing[sid].remove(op.addr)
        return []

    def _done_promote(self, op: _Op, result: dict) -> list:
        sid = op.sids[0]
        gen, others = op.data
        if sid not in result or op.addr not in self.nodes:
            self.needs_primary.add(sid)
            return []
        self.routing[sid] = [op.addr] + [a for a in others if a in self.nodes]
        self.gens[sid] = gen
        self.generation += 1
        self.needs_primary.discard(sid)
        logger.warning(
            "server %s: shard %d promoted on %s at generation %d, version %s",
            self.server_id,
            sid,
            op.addr,
            gen,
            result[sid],
        )
        return [
            LogEvent(
                {
                    "event": "promoted",
                    "server": self.server_id,
                    "shard": sid,
                    "worker": op.addr,
                    "generation": gen,
                }
            )
        ]

    def _done_restore(self, op: _Op, result: Any) -> list:
        sid = op.sids[0]
        gen, version = op.data
        self.routing[sid] = [op.addr]
        self.gens[sid] = gen
        self.generation += 1
        self.restoring.discard(sid)
        seen = self.last_seen.get(sid, (-1, -1))[1]
        lost = max(0, seen - version)
        self.restored.append(
            {"shard": sid, "version": version, "generation": gen, "lost_at_least": lost}
        )
        logger.error(
            "server %s: every copy of shard %d was lost; rebuilt from the checkpoint at "
            "version %d on %s. The updates applied after that write-back are lost (at least "
            "%d known from heartbeats); pushers replay the ones they still hold",
            self.server_id,
            sid,
            version,
            op.addr,
            lost,
        )
        return [
            LogEvent(
                {
                    "event": "shard-restored",
                    "server": self.server_id,
                    "shard": sid,
                    "version": version,
                    "lost_at_least": lost,
                }
            )
        ]

    def _done_assign(self, op: _Op, result: Any) -> list:
        sid, (new, primary) = op.sids[0], op.data
        if self.routing[sid][:1] != [primary] or new not in self.nodes:
            return []
        peers = self._peers(self.routing[sid][1:] + [new])
        call = self._call(
            "add", primary, [sid], "add_backups", ({sid: peers},), involves=[new], data=new
        )
        return [call]

    def _done_add(self, op: _Op, result: Any) -> list:
        sid, new = op.sids[0], op.data
        holders = self.routing[sid]
        if holders[:1] == [op.addr] and new in self.nodes and new not in holders:
            holders.append(new)
            self.generation += 1
        return []

    def _done_set_backups(self, op: _Op, result: Any) -> list:
        return []

    # -- write-back and the manifest -------------------------------------------------------------

    def _on_WriteReport(self, ev: WriteReport) -> list:
        accepted: dict[int, int] = {}
        refused: dict[int, int] = {}
        for sid, (gen, version, path) in ev.blocks.items():
            if ev.addr not in self.nodes:
                refused[sid] = NOT_MEMBER
            elif (
                self.manifest is None
                or self.routing[sid][:1] != [ev.addr]
                or gen != self.gens[sid]
                or sid in self.pending()
            ):
                rnd = self.rounds.get(sid)
                refused[sid] = max(self.gens[sid], rnd.gen if rnd else -1)
            else:
                accepted[sid] = version
                self._name_block(sid, gen, version, path)
            self.last_seen[sid] = max(self.last_seen.get(sid, (-1, -1)), (gen, version))
        if refused:
            self.refused_writes += len(refused)
            logger.warning(
                "server %s: refused write-backs of shards %s from %s (stale generation or not "
                "a member)",
                self.server_id,
                sorted(refused),
                ev.addr,
            )
        return [Reply(ev.req, {"accepted": accepted, "refused": refused})]

    def _name_block(self, sid: int, gen: int, version: int, path: str) -> None:
        m = self.manifest
        assert m is not None
        if (gen, version) <= (m["generations"][sid], m["versions"][sid]):
            return
        old = m["blocks"][sid]
        m["blocks"][sid], m["generations"][sid], m["versions"][sid] = path, gen, version
        if old and old != path:
            self.superseded.append((old, self.seq + 1, self.now))
        self.manifest_dirty = True

    def _on_Commit(self, ev: Commit) -> list:
        if self.manifest is None:
            return [Reply(ev.req, None)]
        if ev.epoch is not None:
            self.manifest["epoch"] = ev.epoch
        if ev.meta is not None:
            self.manifest["meta"] = ev.meta
        self.manifest_dirty = True
        self.commits.append((ev.req, self.seq + 1))
        return []

    def _on_ManifestDone(self, ev: ManifestDone) -> list:
        self.manifest_writing = None
        self.written_seq = max(self.written_seq, ev.seq)
        self.failures.pop("manifest", None)
        out: list = []
        keep = []
        for req, seq in self.commits:
            if seq <= self.written_seq:
                out.append(Reply(req, dict(self.manifest or {})))
            else:
                keep.append((req, seq))
        self.commits = keep
        return out

    def _on_ManifestFailed(self, ev: ManifestFailed) -> list:
        self.now = max(self.now, ev.now)
        self.manifest_writing = None
        self.manifest_dirty = True
        self.manifest_errors += 1
        self.last_manifest_error = ev.error
        self._backoff("manifest")
        logger.warning(
            "server %s: writing the manifest failed (%s); retrying", self.server_id, ev.error
        )
        return []

    def _collect(self) -> list:
        """Delete blocks no manifest has named for two writes and ``block_grace`` seconds."""
        doomed, keep = [], []
        for path, first, since in self.superseded:
            if first + 1 <= self.written_seq and self.now - since >= self.block_grace:
                doomed.append(path)
            else:
                keep.append((path, first, since))
        self.superseded = keep
        return [DeleteBlocks(tuple(doomed))] if doomed else []

    def _manifest_actions(self) -> list:
        if (
            self.manifest is None
            or not self.manifest_dirty
            or self.manifest_writing is not None
            or not self._ready("manifest")
        ):
            return []
        self.seq += 1
        self.manifest["sequence"] = self.seq
        self.manifest_dirty = False
        self.manifest_writing = self.seq
        doc = dict(self.manifest)
        for k in ("versions", "generations", "blocks"):
            doc[k] = list(self.manifest[k])
        return [WriteManifest(self.seq, doc)]

    # -- planning --------------------------------------------------------------------------------

    def _plan(self) -> list:
        """The next calls of the repair, for every shard not waiting for one."""
        out = self._manifest_actions() + self._collect()
        live = self.live()
        load = Counter(a for h in self.routing.values() for a in h)
        out += self._plan_set_backups()
        out += self._plan_rounds()
        out += self._plan_restores(live, load)
        out += self._plan_copies(live, load)
        if self.heal_started is not None and self.healthy():
            took = self.now - self.heal_started
            self.heal_started = None
            self.heal_times.append(took)
            logger.warning(
                "server %s healed: every shard has %d copies again, %.2fs after the loss",
                self.server_id,
                self.target,
                took,
            )
            out.append(
                LogEvent(
                    {
                        "event": "healed",
                        "server": self.server_id,
                        "seconds": took,
                        "generation": self.generation,
                    }
                )
            )
        return out

    def _peers(self, addrs: list[str]) -> list[tuple[str, str]]:
        return [(a, self.nodes[a]) for a in addrs if a in self.nodes]

    def _plan_set_backups(self) -> list:
        out = []
        for sid in sorted(self.backups_changed):
            if sid in self.busy or sid in self.pending() or not self._ready(("shard", sid)):
                continue
            self.backups_changed.discard(sid)
            holders = self.routing[sid]
            if holders and holders[0] in self.nodes:
                args = ({sid: self._peers(holders[1:])},)
                out.append(self._call("set_backups", holders[0], [sid], "set_backups", args))
        return out

    def _plan_rounds(self) -> list:
        out: list = []
        primary_load = Counter(h[0] for s, h in self.routing.items() if h and s not in self.rounds)
        for sid, rnd in sorted(self.rounds.items()):
            if rnd.waiting:
                continue
            del self.rounds[sid]
            cands = {a: p for a, p in rnd.replies.items() if a in self.nodes}
            if not cands:
                self.needs_primary.add(sid)
                continue
            new = choose_primary(cands, primary_load)
            primary_load[new] += 1
            others = [a for a in self.routing[sid] if a != new and a in self.nodes]
            args = ({sid: (rnd.gen, self._peers(others))},)
            out.append(self._call("promote", new, [sid], "promote", args, data=(rnd.gen, others)))
        for sid in sorted(self.needs_primary - set(self.rounds)):
            if sid in self.busy:
                continue
            survivors = [a for a in self.routing[sid] if a in self.nodes]
            self.routing[sid] = survivors
            self.needs_primary.discard(sid)
            if not survivors:
                self.restoring.add(sid)
                continue
            self.generation += 1
            self.rounds[sid] = _Round(self.generation, set(survivors), set(), {})
        asks: dict[str, dict[int, int]] = {}
        for sid, rnd in sorted(self.rounds.items()):
            for addr in sorted(rnd.waiting - rnd.asked):
                if addr in self.nodes and self._ready(("shard", sid)):
                    asks.setdefault(addr, {})[sid] = rnd.gen
                    rnd.asked.add(addr)
        for addr, gens in asks.items():
            out.append(self._call("fence", addr, list(gens), "fence", (gens,), data=gens))
        return out

    def _plan_restores(self, live: dict[str, str], load: Counter) -> list:
        out: list = []
        for sid in sorted(self.restoring):
            if sid in self.busy or not self._ready(("shard", sid)):
                continue
            if self.manifest is None:
                self.restoring.discard(sid)
                self.lost.add(sid)
                logger.error(
                    "server %s: every copy of shard %d is lost and there is no checkpoint",
                    self.server_id,
                    sid,
                )
                out.append(
                    LogEvent({"event": "shard-lost", "server": self.server_id, "shard": sid})
                )
                continue
            target = choose_new_holder([], live, load)
            if target is None:
                continue
            if target not in self.nodes:
                out += self._create(target)
                continue
            load[target] += 1
            self.generation += 1
            m = self.manifest
            start, stop = self.shards[sid]
            block = (m["blocks"][sid], m["generations"][sid], m["versions"][sid])
            args = (sid, self.generation, start, stop, block)
            data = (self.generation, int(m["versions"][sid]))
            out.append(self._call("restore", target, [sid], "restore", args, data=data))
        return out

    def _plan_copies(self, live: dict[str, str], load: Counter) -> list:
        out: list = []
        for sid, holders in sorted(self.routing.items()):
            if (
                len(holders) >= self.target
                or not holders
                or holders[0] not in self.nodes
                or sid in self.busy
                or sid in self.pending()
                or sid in self.backups_changed
                or not self._ready(("shard", sid))
            ):
                continue
            new = choose_new_holder(holders, live, load)
            if new is None:
                continue
            if new not in self.nodes:
                out += self._create(new)
                continue
            load[new] += 1
            start, stop = self.shards[sid]
            args = ({sid: (start, stop)}, {sid: self.gens[sid]}, {}, -1)
            out.append(
                self._call(
                    "assign",
                    new,
                    [sid],
                    "assign",
                    args,
                    involves=[holders[0]],
                    data=(new, holders[0]),
                )
            )
        return out

    def _create(self, addr: str) -> list:
        if addr in self.creating or not self._ready(("node", addr)):
            return []
        self.creating.add(addr)
        return [CreateNode(addr)]
