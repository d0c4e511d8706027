"""The world of the PS simulation (:mod:`adam_dask.testing.simulation`): a clock, a network of
messages that are delayed, reordered, dropped and duplicated, PS nodes that are killed or frozen,
a storage that has outages, and the controller; every choice drawn from one seeded generator.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from ..ps.protocol.controller import ServerState
from ..ps.protocol.controller_machine import handle as handle_ctl
from ..ps.protocol.courier_plan import replay_budget
from ..ps.protocol.messages import (
    Beat,
    Call,
    Cancel,
    CreateNode,
    DeleteBlocks,
    Forward,
    LogEvent,
    Replicate,
    Reply,
    Retire,
    Tick,
    WriteBlocks,
    WriteFailed,
    WriteManifest,
    WriteReport,
)
from ..ps.protocol.node_commands import command
from ..ps.protocol.node_machine import handle
from ..ps.protocol.node_state import NodeState
from ..ps.protocol.optimizer import ServerOptimizer
from ..ps.protocol.policy import plan_placement
from .sim_pusher import Pusher, drawn_replay_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "BEAT_INTERVAL",
    "CallRecord",
    "SimNode",
    "SimulationFailure",
    "World",
    "brief",
]


CALL_TIMEOUT = 30.0
FAILOVER_TIMEOUT = 60.0
FORWARD_INTERVAL = 0.25
WRITE_INTERVAL = 1.0
BEAT_INTERVAL = 0.25
BEAT_TIMEOUT = 2.0
RETIRE_TIMEOUT = 4.0
TICK_INTERVAL = 0.1


def brief(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 160 else text[:157] + "..."


@dataclass
class SimNode:
    addr: str
    key: str
    state: NodeState
    frozen_until: float | None = None
    doomed_after: int | None = None  # steps it still takes after waking (it was retired)
    next_forward: float = 0.0
    next_write: float = 0.0
    next_beat: float = 0.0
    forwards: dict[str, int] = field(default_factory=dict)  # backup -> call id


@dataclass
class CallRecord:
    caller: str
    callee: str
    kind: str
    info: Any
    deadline: float
    caller_key: str | None = None  # the node incarnation that called (its answer goes to it)
    callee_key: str | None = None  # the node incarnation called (another one does not answer)


class SimulationFailure(AssertionError):
    """An invariant of the simulation broke; the message holds the seed and the trace."""


class World:
    """Nodes, controller, pushers and the network between them (see the module doc)."""

    def __init__(
        self,
        seed: int,
        faults: bool,
        ack: str | None = None,
        optimizer: Any = None,
        rounds: int = 0,
        replay_bytes: int | None = None,
    ):
        # the server optimizer (not drawn: a seed runs the same faults with either)
        self.optimizer = ServerOptimizer.from_dict(optimizer)
        self.rounds = int(rounds)  # > 0: push k is a share of synchronous step k // rounds
        self.rng = random.Random(seed)
        rng = self.rng
        # whether a started node's first beat overtakes the answer to its start: a stream of
        # its own, so schedules that create no node stay those of the seed before it was drawn
        self.start_rng = random.Random(f"{seed}:node-start")
        self.seed = seed
        self.now = 0.0
        self.trace: list[str] = []
        self.n_nodes = rng.randint(3, 5)
        self.n_shards = rng.randint(1, 3)
        self.copies = 3
        self.total_pushes = rng.randint(12, 40)
        self.ack = rng.choice(["replay", "replay", "replay", "all"])
        self.ack = ack or self.ack
        self.faults = faults
        self.fault_budget = rng.randint(1, 4) if faults else 0
        self.p_drop = rng.choice([0.0, 0.02, 0.05]) if faults else 0.0
        self.p_dup = rng.choice([0.0, 0.02, 0.05]) if faults else 0.0
        self.outage_until = -1.0
        self.faults_end = 0.0  # when the last fault so far ends (a freeze or outage lasts)
        self.msgs: list[tuple[float, int, str, str, int, Any]] = []  # due, seq, dst, kind, call, x
        self.calls: dict[int, CallRecord] = {}
        self.next_deadline = float("inf")  # no call's deadline comes before (a lower bound)
        self.seqno = 0
        self.worker_no = 0
        self.nodes: dict[str, SimNode] = {}
        self.crashed: set[str] = set()
        # path -> (values, version, gen, push ids, the optimizer's state, the marks)
        self.blocks: dict[str, tuple[np.ndarray, int, int, tuple, np.ndarray | None, tuple]] = {}
        self.manifests: list[dict] = []
        self.acked: dict[int, set[int]] = {}  # push -> shards acknowledged
        self.lost_ok: dict[int, set[int]] = {}  # shard -> pushes a restore may have lost
        self.acked_bits = [0] * self.n_shards  # per shard, a bit per acknowledged push
        self.lost_bits = [0] * self.n_shards  # per shard, a bit per push a restore may lose
        self.checked_manifests = 0
        self.dirty: set[str] = set()
        self.changed = True
        self.pushes_started = 0
        n = self.total_pushes
        shards = [(s * n, (s + 1) * n) for s in range(self.n_shards)]
        self.shards = shards
        workers = {self._new_worker(): "" for _ in range(self.n_nodes)}
        hosts = {a: f"host-{a}" for a in workers}
        plan = plan_placement(self.n_shards, hosts, self.copies)
        manifest = {
            "sequence": 0,
            "versions": [0] * self.n_shards,
            "generations": [0] * self.n_shards,
            "blocks": [f"shards/{s}/g0-v0" for s in range(self.n_shards)],
            "epoch": None,
            "meta": {},
        }
        for s in range(self.n_shards):
            empty = (np.zeros(n, np.float32), 0, 0, (), self.optimizer.new_state(n), ())
            self.blocks[f"shards/{s}/g0-v0"] = empty
        self.manifests.append(manifest)
        for addr in hosts:
            self.nodes[addr] = self._make_node(addr)
        for addr in hosts:
            st = self.nodes[addr].state
            held = {s: shards[s] for s, h in plan.items() if addr in h}
            prim = {
                s: [(b, self.nodes_key(b)) for b in h[1:]] for s, h in plan.items() if h[0] == addr
            }
            handle(st, command("assign", None, (held, dict.fromkeys(held, 0), prim, 0)))
        self.ctl = ServerState(
            "sim",
            shards,
            target=min(self.copies, self.n_nodes),
            routing=plan,
            nodes={a: self.nodes_key(a) for a in hosts},
            workers=hosts,
            gens=dict.fromkeys(range(self.n_shards), 0),
            generation=0,
            manifest=manifest,
            now=0.0,
            heartbeat_timeout=BEAT_TIMEOUT,
            retire_timeout=RETIRE_TIMEOUT,
            block_grace=1.0,
            retry_base=0.2,
            retry_max=2.0,
        )
        self.next_tick = 0.0
        size = self.n_shards * n
        if replay_bytes is None:
            replay_bytes = drawn_replay_bytes(seed, size)
        self.budget = replay_budget(replay_bytes, size)  # the pushers' (adam.ps.replay-bytes)
        self.pushers = [
            Pusher.make(f"pusher{i}", shards, self.budget, FAILOVER_TIMEOUT, FORWARD_INTERVAL)
            for i in range(rng.randint(2, 3))
        ]
        for p in self.pushers:
            p.routing.set(self.ctl.routing_info())

    # -- plumbing --------------------------------------------------------------------------------

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:8.2f} {text}")

    def fail(self, what: str) -> NoReturn:
        """An invariant broke: the seed, how to replay it and the trace's last 400 steps."""
        tail = "\n".join(self.trace[-400:])
        raise SimulationFailure(
            f"seed {self.seed}: {what}\n(replay: adam_dask.testing.simulation.simulate({self.seed}, "
            f"trace=True))\n--- trace (last 400 steps) ---\n{tail}"
        )

    def nodes_key(self, addr: str) -> str:
        """The key of the node incarnation on ``addr`` now."""
        return self.nodes[addr].key

    def _new_worker(self) -> str:
        self.worker_no += 1
        return f"w{self.worker_no}"

    def _make_node(self, addr: str) -> SimNode:
        st = NodeState(
            addr, dedup_window=4 * self.total_pushes, checkpoint=True, optimizer=self.optimizer
        )
        off = self.rng.random()
        self.seqno += 1
        key = f"key-{addr}-{self.seqno}"
        return SimNode(addr, key, st, None, None, off * 0.25, off, off * 0.25)

    def held_pushes(self, values: np.ndarray, ids: Iterable[tuple[int, int]]) -> int:
        """The pushes a copy (or a block) holds, a bit each: push ``k`` adds 1 at index ``k``,
        so with the sum its values say (the ``k`` where they are 1); with another optimizer
        the values are the optimizer's, and the push ids remembered with them say (the
        dedup window holds every push of a run)."""
        if self.optimizer.is_sum:
            return int.from_bytes(np.packbits(values == 1, bitorder="little").tobytes(), "little")
        return self.held_pushes_by_ids(ids)

    def held_pushes_by_ids(self, ids: Iterable[tuple[int, int]]) -> int:
        """The pushes a copy remembers having applied, a bit each."""
        return sum(1 << int(p) for _, p in ids)

    def holds_twice(self, values: np.ndarray, ids: tuple, version: int) -> bool:
        """Whether a copy holds some push twice: a value over 1 (the sum), or more versions
        than pushes applied (each applied push makes one version and is remembered; a new copy
        is at version -1 until its first forward)."""
        if self.optimizer.is_sum and (values.max(initial=0) > 1 or values.min(initial=0) < 0):
            return True
        return version >= 0 and len({int(p) for _, p in ids}) != version  # -1: no copy yet

    def send(self, dst: str, kind: str, call: int, x: Any, delay: float | None = None) -> None:
        """A message; over the network (not to the scheduler's own storage or bookkeeping) it
        may be dropped or duplicated."""
        lossy = dst != "sched" and call in self.calls
        if lossy and self.rng.random() < self.p_drop:
            # a broken connection: the caller hears of it (TCP loses nothing silently)
            self.log(f"  drop {kind} #{call} -> {dst}")
            rec = self.calls[call]
            self.seqno += 1
            err = OSError("connection lost")
            self.msgs.append((self.now + 0.01, self.seqno, rec.caller, "reply", call, err))
            return
        copies = 2 if lossy and self.rng.random() < self.p_dup else 1
        if copies == 2:
            self.log(f"  duplicate {kind} #{call} -> {dst}")
        for _ in range(copies):
            d = self.rng.choice([0.0, 0.001, 0.01, 0.05, 0.2]) if delay is None else delay
            self.seqno += 1
            self.msgs.append((self.now + d, self.seqno, dst, kind, call, x))

    def request(
        self, caller: str, callee: str, kind: str, event: Any, info: Any = None, key: Any = None
    ) -> int:
        self.seqno += 1
        cid = self.seqno
        caller_key = self.nodes[caller].key if caller in self.nodes else None
        rec = CallRecord(caller, callee, kind, info, self.now + CALL_TIMEOUT, caller_key, key)
        self.calls[cid] = rec
        self.next_deadline = min(self.next_deadline, rec.deadline)
        self.send(callee, "request", cid, (kind, event))
        return cid

    def reply(self, cid: int, value: Any) -> None:
        rec = self.calls.get(cid)
        if rec is not None:
            self.send(rec.caller, "reply", cid, value)

    def alive(self, addr: str) -> bool:
        return addr in self.nodes and addr not in self.crashed

    def running(self, addr: str) -> bool:
        node = self.nodes.get(addr)
        return node is not None and addr not in self.crashed and node.frozen_until is None

    # -- carrying out actions --------------------------------------------------------------------

    def node_actions(self, node: SimNode, actions: list) -> None:
        for a in actions:
            if isinstance(a, Reply):
                self.reply(a.req, a.value)
            elif isinstance(a, Forward):
                ev = Replicate(None, node.addr, a.snaps)
                cid = self.request(node.addr, a.addr, "replicate", ev, key=a.key)
                node.forwards[a.addr] = cid
            elif isinstance(a, Cancel):
                fwd = node.forwards.pop(a.addr, None) if a.addr is not None else None
                if fwd is not None:
                    self.calls.pop(fwd, None)
            elif isinstance(a, WriteBlocks):
                if self.now < self.outage_until:
                    self.node_handle(node, WriteFailed("storage outage"))
                    continue
                blocks = {}
                for snap in a.snaps:
                    if self.holds_twice(snap.values, snap.ids, snap.version):
                        self.fail(f"{node.addr} writes a block holding a push twice")
                    path = f"shards/{snap.shard}/g{snap.gen}-v{snap.version}"
                    state = None if snap.state is None else snap.state.copy()
                    self.blocks[path] = (
                        snap.values.copy(),
                        snap.version,
                        snap.gen,
                        snap.ids,
                        state,
                        snap.marks,
                    )
                    blocks[snap.shard] = (snap.gen, snap.version, path)
                self.request(node.addr, "ctl", "report", WriteReport(None, node.addr, blocks))
            else:
                raise TypeError(a)

    def ctl_actions(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Reply):
                self.reply(a.req, a.value)
            elif isinstance(a, Call):
                self.log(f"  ctl op {a.op}: {a.method} on {a.addr} {brief(a.args)}")
                self.request("ctl", a.addr, "command", (a.method, a.args), info=a.op, key=a.key)
            elif isinstance(a, Cancel):
                for cid, rec in list(self.calls.items()):
                    if rec.caller == "ctl" and rec.info == a.op:
                        del self.calls[cid]
            elif isinstance(a, CreateNode):
                give_up = self.now + CALL_TIMEOUT  # the plugin waits this long for the actor
                delay = self.rng.choice([0.05, 0.3])
                self.send("sched", "create", 0, (a.addr, give_up), delay=delay)
            elif isinstance(a, Retire):
                self.retire(a.addr)
            elif isinstance(a, WriteManifest):
                if self.now < self.outage_until:
                    self.send("sched", "manifest-failed", 0, a.seq, delay=0.05)
                else:
                    self.send("sched", "manifest", 0, (a.seq, a.doc), delay=0.02)
            elif isinstance(a, DeleteBlocks):
                for p in a.paths:
                    self.blocks.pop(p, None)
            elif isinstance(a, LogEvent):
                self.log(f"  event {a.msg.get('event')}")
            else:
                raise TypeError(a)

    def ctl_handle(self, event: Any) -> None:
        actions = handle_ctl(self.ctl, event)
        self.ctl.validate()
        # a tick or a heartbeat that the controller answers with its reply alone changed
        # nothing the checks read (routing, rounds, calls, generations): the controller acts on
        # each change it makes, in the same pass (its repair settles every consequence of an
        # event before it returns; what waits for a back-off acts when the back-off ends)
        if not isinstance(event, (Tick, Beat)) or any(not isinstance(a, Reply) for a in actions):
            self.changed = True
        self.ctl_actions(actions)

    def node_handle(self, node: SimNode, event: Any) -> None:
        self.dirty.add(node.addr)
        actions = handle(node.state, event)
        node.state.validate()
        self.node_actions(node, actions)

    # -- faults ----------------------------------------------------------------------------------

    def crash(self, addr: str) -> None:
        self.changed = True
        self.log(f"FAULT crash {addr}")
        self.faults_end = max(self.faults_end, self.now)
        self.crashed.add(addr)
        self.send("sched", "removed", 0, addr, delay=self.rng.choice([0.1, 0.5, 1.5]))
        self.send("sched", "added", 0, self._new_worker(), delay=self.rng.choice([1.0, 3.0]))

    def retire(self, addr: str) -> None:
        node = self.nodes.get(addr)
        self.log(f"  retire {addr}")
        if node is None or addr in self.crashed:
            return
        if node.frozen_until is None:
            self.crashed.add(addr)
        else:
            node.doomed_after = self.rng.randint(0, 30)
        self.send("sched", "removed", 0, addr, delay=0.01)
        self.send("sched", "added", 0, self._new_worker(), delay=self.rng.choice([1.0, 3.0]))

    def fault(self) -> None:
        live = [a for a in self.nodes if self.running(a)]
        kind = self.rng.choice(["crash", "crash", "freeze", "freeze", "outage", "crash-many"])
        self.fault_budget -= 1
        if kind == "crash" and live:
            self.crash(self.rng.choice(live))
        elif kind == "crash-many" and live:
            holders = self.ctl.routing[self.rng.randrange(self.n_shards)]
            for a in holders:
                if self.running(a):
                    self.crash(a)
        elif kind == "freeze" and live:
            addr = self.rng.choice(live)
            thaw = self.now + self.rng.choice([0.5, 1.5, 3.0, 6.0])
            self.nodes[addr].frozen_until = thaw
            self.faults_end = max(self.faults_end, thaw)
            self.log(f"FAULT freeze {addr} until {self.nodes[addr].frozen_until:.2f}")
        elif kind == "outage":
            self.outage_until = self.now + self.rng.choice([1.0, 4.0])
            self.faults_end = max(self.faults_end, self.outage_until)
            self.log(f"FAULT storage outage until {self.outage_until:.2f}")

    # -- the loop --------------------------------------------------------------------------------

    def ready(self) -> list[tuple[str, Any]]:
        """What may happen now: messages due (not to a frozen node), timers of running nodes,
        the controller's tick, pushers free to act; in this order (the seed's choices index
        it)."""
        now, nodes, crashed = self.now, self.nodes, self.crashed
        out: list[tuple[str, Any]] = []
        for m in self.msgs:
            if m[0] <= now:
                node = nodes.get(m[2])
                if node is None or node.frozen_until is None or m[2] in crashed:
                    out.append(("msg", m))
        for node in nodes.values():
            if node.frozen_until is not None or node.addr in crashed:
                continue
            if node.next_forward <= now:
                out.append(("timer", (node, "next_forward")))
            if node.next_write <= now:
                out.append(("timer", (node, "next_write")))
            if node.next_beat <= now:
                out.append(("timer", (node, "next_beat")))
        if self.next_tick <= now:
            out.append(("tick", None))
        more = self.pushes_started < self.total_pushes
        for p in self.pushers:
            busy = p.delivery is not None or p.retry is not None or p.pushing
            if not p.calls and p.next_act <= now and (busy or more or p.log):
                out.append(("pusher", p))
        return out

    def _frozen(self, dst: str) -> bool:
        node = self.nodes.get(dst)
        return node is not None and node.frozen_until is not None and dst not in self.crashed

    def advance(self) -> None:
        """Nothing may happen now: on to the next time something may."""
        now, nodes, crashed = self.now, self.nodes, self.crashed
        later = float("inf")
        for m in self.msgs:
            t = m[0]
            if now < t < later:
                node = nodes.get(m[2])
                if node is None or node.frozen_until is None or m[2] in crashed:
                    later = t
        for rec in self.calls.values():
            if now < rec.deadline < later:
                later = rec.deadline
        for node in nodes.values():
            thaw = node.frozen_until
            if thaw is not None:
                if now < thaw < later:
                    later = thaw
            elif node.addr not in crashed:
                for t in (node.next_forward, node.next_write, node.next_beat):
                    if now < t < later:
                        later = t
        if now < self.next_tick < later:
            later = self.next_tick
        for p in self.pushers:
            if not p.calls and now < p.next_act < later:
                later = p.next_act
        self.now = later if later != float("inf") else now + 0.1
