"""A deterministic simulation of the parameter-server protocol, on the pure state machines.

:func:`simulate` runs, from one seed, a few PS nodes (:class:`~adam_dask.ps._node_state.NodeState`),
the controller (:class:`~adam_dask.ps._controller.ServerState`) and several pushers over a
simulated network and clock: messages are delayed, reordered, dropped and duplicated; nodes are
killed (their worker comes back under a new address, empty), frozen (sockets open, nothing
answers; after a while they wake and act on what they knew) and storage has outages. Every
choice comes from ``random.Random(seed)``, so a seed replays exactly.

After every step it checks:

* **at most once**: no copy of a shard, and no checkpoint block, holds any push twice;
* **nothing acknowledged lost**: every push a pusher was told is applied is held by a live copy
  the controller routes to, by the pusher itself (not yet confirmed), or by the checkpoint;
  it may go only when every copy of its shard is lost, and then only if the shard's restore
  from the checkpoint accounts for it;
* **the manifest never goes back**: sequence numbers and each shard's ``(generation, version)``
  only grow, and every block the newest manifest names exists.

At the end faults stop, the system heals, pushers settle, and it checks that the copies of every
shard converge and hold every acknowledged push once (less those lost with all their copies).

Each push ``k`` adds 1 at index ``k`` of every shard, so a copy's values say exactly which
pushes it holds and how many times.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._controller import ServerState
from ._messages import (
    Beat,
    Call,
    CallDone,
    CallFailed,
    Cancel,
    Confirmed,
    CreateNode,
    DeleteBlocks,
    Forward,
    ForwardDone,
    ForwardDue,
    ForwardFailed,
    HeartbeatReply,
    LogEvent,
    ManifestDone,
    ManifestFailed,
    NodeReady,
    Push,
    Pushes,
    Replicate,
    Reply,
    Restore,
    Retire,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    WriteBlocks,
    WriteDone,
    WriteDue,
    WriteFailed,
    WriteManifest,
    WriteReport,
)
from ._node_state import NodeState, command
from ._replay import HeldPush, ReplayLog
from .placement import plan_placement

logger = logging.getLogger(__name__)

__all__ = ["SimulationFailure", "simulate"]

CALL_TIMEOUT = 30.0
FORWARD_INTERVAL = 0.25
WRITE_INTERVAL = 1.0
BEAT_INTERVAL = 0.25
BEAT_TIMEOUT = 2.0
RETIRE_TIMEOUT = 4.0
TICK_INTERVAL = 0.1


def _brief(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 160 else text[:157] + "..."


class SimulationFailure(AssertionError):
    """An invariant broke; the message names the seed and ends with the trace."""


@dataclass
class _Node:
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
class _Callrec:
    caller: str
    callee: str
    kind: str
    info: Any
    deadline: float
    caller_key: str | None = None  # the node incarnation that called (its answer goes to it)
    callee_key: str | None = None  # the node incarnation called (another one does not answer)


@dataclass
class _Pusher:
    name: str
    log: ReplayLog = field(default_factory=ReplayLog)
    routing: dict = field(default_factory=dict)
    current: dict | None = None  # the push in progress
    calls: dict[int, tuple[str, str, Any]] = field(default_factory=dict)  # id -> (addr, what, x)
    next_act: float = 0.0


class _Sim:
    def __init__(self, seed: int, faults: bool, ack: str | None = None):
        self.rng = random.Random(seed)
        rng = self.rng
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
        self.msgs: list[tuple[float, int, str, str, int, Any]] = []  # due, seq, dst, kind, call, x
        self.calls: dict[int, _Callrec] = {}
        self.seqno = 0
        self.worker_no = 0
        self.nodes: dict[str, _Node] = {}
        self.crashed: set[str] = set()
        self.blocks: dict[str, tuple[np.ndarray, int, int, tuple]] = {}
        self.manifests: list[dict] = []
        self.acked: dict[int, set[int]] = {}  # push -> shards acknowledged
        self.lost_ok: dict[int, set[int]] = {}  # shard -> pushes a restore may have lost
        self.acked_mask = np.zeros((self.n_shards, self.total_pushes), bool)
        self.lost_mask = np.zeros((self.n_shards, self.total_pushes), bool)
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
            self.blocks[f"shards/{s}/g0-v0"] = (np.zeros(n, np.float32), 0, 0, ())
        self.manifests.append(manifest)
        for addr in hosts:
            self.nodes[addr] = self._make_node(addr)
        for addr in hosts:
            st = self.nodes[addr].state
            held = {s: shards[s] for s, h in plan.items() if addr in h}
            prim = {
                s: [(b, self.nodes_key(b)) for b in h[1:]] for s, h in plan.items() if h[0] == addr
            }
            st.handle(command("assign", None, (held, dict.fromkeys(held, 0), prim, 0)))
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
        self.pushers = [_Pusher(f"pusher{i}") for i in range(rng.randint(2, 3))]
        for p in self.pushers:
            p.routing = self.ctl.routing_info()

    # -- plumbing --------------------------------------------------------------------------------

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:8.2f} {text}")

    def nodes_key(self, addr: str) -> str:
        """The key of the node incarnation on ``addr`` now."""
        return self.nodes[addr].key

    def _new_worker(self) -> str:
        self.worker_no += 1
        return f"w{self.worker_no}"

    def _make_node(self, addr: str) -> _Node:
        st = NodeState(addr, dedup_window=4 * self.total_pushes, checkpoint=True)
        off = self.rng.random()
        self.seqno += 1
        key = f"key-{addr}-{self.seqno}"
        return _Node(addr, key, st, None, None, off * 0.25, off, off * 0.25)

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
        rec = _Callrec(caller, callee, kind, info, self.now + CALL_TIMEOUT, caller_key, key)
        self.calls[cid] = rec
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

    def node_actions(self, node: _Node, actions: list) -> None:
        for a in actions:
            if isinstance(a, Reply):
                self.reply(a.req, a.value)
            elif isinstance(a, Forward):
                ev = Replicate(None, node.addr, a.snaps)
                cid = self.request(node.addr, a.addr, "replicate", ev, key=a.key)
                node.forwards[a.addr] = cid
            elif isinstance(a, Cancel):
                cid = node.forwards.pop(a.addr, None)
                self.calls.pop(cid, None)
            elif isinstance(a, WriteBlocks):
                if self.now < self.outage_until:
                    self.node_handle(node, WriteFailed("storage outage"))
                    continue
                blocks = {}
                for snap in a.snaps:
                    if snap.values.max(initial=0) > 1:
                        self.fail(f"{node.addr} writes a block holding a push twice")
                    path = f"shards/{snap.shard}/g{snap.gen}-v{snap.version}"
                    self.blocks[path] = (snap.values.copy(), snap.version, snap.gen, snap.ids)
                    blocks[snap.shard] = (snap.gen, snap.version, path)
                self.request(node.addr, "ctl", "report", WriteReport(None, node.addr, blocks))
            else:
                raise TypeError(a)

    def ctl_actions(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Reply):
                self.reply(a.req, a.value)
            elif isinstance(a, Call):
                self.log(f"  ctl op {a.op}: {a.method} on {a.addr} {_brief(a.args)}")
                self.request("ctl", a.addr, "command", (a.method, a.args), info=a.op, key=a.key)
            elif isinstance(a, Cancel):
                for cid, rec in list(self.calls.items()):
                    if rec.caller == "ctl" and rec.info == a.op:
                        del self.calls[cid]
            elif isinstance(a, CreateNode):
                self.send("sched", "create", 0, a.addr, delay=self.rng.choice([0.05, 0.3]))
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
        self.changed = True
        self.ctl_actions(self.ctl.handle(event))

    def node_handle(self, node: _Node, event: Any) -> None:
        self.dirty.add(node.addr)
        self.node_actions(node, node.state.handle(event))

    # -- faults ----------------------------------------------------------------------------------

    def crash(self, addr: str) -> None:
        self.changed = True
        self.log(f"FAULT crash {addr}")
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
            self.nodes[addr].frozen_until = self.now + self.rng.choice([0.5, 1.5, 3.0, 6.0])
            self.log(f"FAULT freeze {addr} until {self.nodes[addr].frozen_until:.2f}")
        elif kind == "outage":
            self.outage_until = self.now + self.rng.choice([1.0, 4.0])
            self.log(f"FAULT storage outage until {self.outage_until:.2f}")

    # -- delivery --------------------------------------------------------------------------------

    def deliver(self, msg: tuple) -> None:
        _, _, dst, kind, cid, x = msg
        if dst == "sched":
            self.scheduler_message(kind, x)
        elif dst == "ctl":
            self.to_controller(kind, cid, x)
        elif dst.startswith("pusher"):
            rec = self.calls.pop(cid, None)
            if rec is not None:
                self.pusher_reply(self.pushers[int(dst[6:])], cid, x)
        else:
            self.to_node(dst, kind, cid, x)

    def scheduler_message(self, kind: str, x: Any) -> None:
        if kind == "create":
            if x not in self.ctl.workers or x in self.crashed:
                return
            old = self.nodes.get(x)
            if old is not None and old.frozen_until is not None:
                return  # the worker cannot start an actor while frozen
            self.nodes[x] = self._make_node(x)  # a new actor (an old one there is no member)
            self.nodes[x].next_beat = self.now
            self.log(f"  node ready {x} ({self.nodes[x].key})")
            self.ctl_handle(NodeReady(x, self.nodes_key(x), self.now))
        elif kind == "removed":
            self.ctl_handle(WorkerRemoved(x, self.now))
        elif kind == "added":
            self.log(f"  worker {x} joins")
            self.ctl_handle(WorkerAdded(x, f"host-{x}", self.now))
        elif kind == "manifest":
            seq, doc = x
            if self.now < self.outage_until:
                self.ctl_handle(ManifestFailed(seq, "outage", self.now))
                return
            self.manifests.append(doc)
            self.log(f"  manifest {seq}: {doc['versions']} gens {doc['generations']}")
            self.ctl_handle(ManifestDone(seq))
        elif kind == "manifest-failed":
            self.ctl_handle(ManifestFailed(x, "outage", self.now))

    def to_controller(self, kind: str, cid: int, x: Any) -> None:
        if kind == "reply":
            rec = self.calls.pop(cid, None)
            if rec is None:
                return
            self.log(f"  ctl op {rec.info} answered: {_brief(x)}")
            if isinstance(x, BaseException):
                self.ctl_handle(CallFailed(rec.info, repr(x)))
            else:
                self.ctl_handle(CallDone(rec.info, x))
            return
        what, ev = x
        if what == "report":
            self.ctl_handle(WriteReport(cid, ev.addr, ev.blocks))
        elif what == "beat":
            self.ctl_handle(Beat(cid, ev.addr, ev.key, self.now, ev.positions))

    def to_node(self, addr: str, kind: str, cid: int, x: Any) -> None:
        node = self.nodes.get(addr)
        if node is None or addr in self.crashed:
            if kind == "request":
                self.reply(cid, OSError(f"{addr} is gone"))
            return
        self.spend(node)
        if kind == "reply":
            rec = self.calls.get(cid)
            if rec is None or rec.caller_key != node.key:
                return  # an answer to an incarnation that is gone
            del self.calls[cid]
            self.node_reply(node, rec, x)
            return
        rec = self.calls.get(cid)
        if rec is not None and rec.callee_key is not None and rec.callee_key != node.key:
            self.reply(cid, ValueError(f"no actor {rec.callee_key} on {addr}"))
            return
        what, ev = x
        if what == "replicate":
            self.node_handle(node, Replicate(cid, ev.sender, ev.snaps))
        elif what == "push":
            self.node_handle(node, Pushes((Push(cid, ev.deltas, ev.push_id, ev.stamps, ev.ack),)))
        elif what == "confirmed":
            self.node_handle(node, Confirmed(cid, ev.sids))
        elif what == "command":
            method, args = ev
            if method == "restore":
                self.restore(node, cid, *args)
            else:
                self.node_handle(node, command(method, cid, args))

    def restore(
        self, node: _Node, cid: int, sid: int, gen: int, start: int, stop: int, block: tuple
    ) -> None:
        path = block[0]
        if path not in self.blocks:
            self.reply(cid, FileNotFoundError(path))
            return
        values, version, _, ids = self.blocks[path]
        # what went with every copy: pushes made so far (an answer may still be on its way)
        # that the block lacks and no pusher holds
        held = {h.push_id for h in self._held(sid)}
        for k in range(self.pushes_started):
            if values[k] == 0 and k not in held:
                self.lost_ok.setdefault(sid, set()).add(k)
                self.lost_mask[sid, k] = True
        self.log(
            f"  restore shard {sid} on {node.addr} from {path}; lost {sorted(self.lost_ok.get(sid, ()))}"
        )
        self.node_handle(node, Restore(cid, sid, gen, start, stop, version, values.copy(), ids))

    def node_reply(self, node: _Node, rec: _Callrec, x: Any) -> None:
        if rec.kind == "replicate":
            if node.forwards.get(rec.callee) is not None:
                node.forwards.pop(rec.callee, None)
            if isinstance(x, BaseException):
                self.node_handle(node, ForwardFailed(rec.callee, repr(x)))
            else:
                self.node_handle(node, ForwardDone(rec.callee, x["held"], x["refused"]))
        elif rec.kind == "report":
            if isinstance(x, BaseException):
                self.node_handle(node, WriteFailed(repr(x)))
            else:
                self.node_handle(node, WriteDone(x["accepted"], x["refused"]))
        elif rec.kind == "beat":
            if not isinstance(x, BaseException):
                self.node_handle(node, HeartbeatReply(x["member"], x["gens"]))

    def spend(self, node: _Node) -> None:
        """A retired node that woke up takes a few more steps, then its worker closes."""
        if node.doomed_after is not None and node.frozen_until is None:
            node.doomed_after -= 1
            if node.doomed_after < 0:
                self.log(f"  {node.addr} closes")
                self.crashed.add(node.addr)

    # -- pushers ---------------------------------------------------------------------------------

    def _held(self, sid: int) -> list[HeldPush]:
        return [h for p in self.pushers for h in p.log.held(sid)]

    def onehot(self, k: int) -> np.ndarray:
        d = np.zeros(self.total_pushes, np.float32)
        d[k] = 1
        return d

    def primaries(self, p: _Pusher) -> dict[int, tuple[str, int]]:
        r = p.routing
        return {
            s: (h[0], r["gens"][s])
            for s, h in enumerate(r["routing"])
            if h and s not in r["pending"] and h[0] in r["nodes"]
        }

    def pusher_call(self, p: _Pusher, addr: str, what: str, ev: Any, info: Any) -> None:
        cid = self.request(p.name, addr, what, ev, key=p.routing["nodes"].get(addr))
        p.calls[cid] = (addr, what, info)

    def pusher_act(self, p: _Pusher) -> None:
        prim = self.primaries(p)
        stamps = dict(enumerate(p.routing["gens"]))
        moved = p.log.moved(prim)
        if moved:
            for sid, items in moved.items():
                for h in items:
                    ev = Push(None, {sid: self.onehot(h.payload)}, h.push_id, stamps, self.ack)
                    self.pusher_call(p, prim[sid][0], "push", ev, ("replay", h.push_id))
            return
        if (
            p.current is None
            and self.pushes_started < self.total_pushes
            and self.rng.random() < 0.6
        ):
            k = self.pushes_started
            self.pushes_started += 1
            p.current = {"k": k, "todo": set(range(self.n_shards))}
            self.log(f"{p.name} starts push {k}")
        if p.current is not None:
            todo = p.current["todo"]
            if any(s not in prim for s in todo):
                p.routing = self.ctl.routing_info()
                return
            groups: dict[str, list[int]] = {}
            for s in sorted(todo):
                groups.setdefault(prim[s][0], []).append(s)
            k = p.current["k"]
            for addr, sids in groups.items():
                ev = Push(None, {s: self.onehot(k) for s in sids}, k, stamps, self.ack)
                self.pusher_call(p, addr, "push", ev, ("push", k))
        elif p.log and self.rng.random() < 0.5:
            p.routing = self.ctl.routing_info()  # the client's settler reads it every round
            prim = self.primaries(p)
            if p.log.moved(prim):
                return
            groups = {}
            for s in p.log.shards():
                if s in prim:
                    groups.setdefault(prim[s][0], []).append(s)
            for addr, sids in groups.items():
                ev = Confirmed(None, tuple(sids))
                self.pusher_call(p, addr, "confirmed", ev, ("confirmed", None))

    def pusher_reply(self, p: _Pusher, cid: int, x: Any) -> None:
        self.changed = True
        addr, what, (kind, k) = p.calls.pop(cid)
        if isinstance(x, BaseException):
            p.routing = self.ctl.routing_info()
            return
        if what == "confirmed":
            for s, v in x["per_shard"].items():
                p.log.confirm(s, addr, x["gens"][s], v)
        else:
            for s, v in x["per_shard"].items():
                if kind == "push" and p.current is not None and p.current["k"] == k:
                    p.current["todo"].discard(s)
                    if self.ack == "replay":
                        p.log.add(s, HeldPush(k, "push", k, addr, x["gens"][s], v, 1))
                elif kind == "replay":
                    p.log.acknowledged(s, k, addr, x["gens"][s], v)
            for s, v in x.get("confirmed", {}).items():
                p.log.confirm(s, addr, x["gens"][s], v)
            if (
                kind == "push"
                and p.current is not None
                and p.current["k"] == k
                and not p.current["todo"]
            ):
                self.acked[k] = set(range(self.n_shards))
                self.acked_mask[:, k] = True
                self.log(f"{p.name} push {k} acknowledged")
                p.current = None
        if x.get("moved"):
            p.routing = self.ctl.routing_info()

    def pusher_guard(self) -> None:
        """A pusher gives up calls to nodes the controller dropped (the client polls it)."""
        for p in self.pushers:
            for cid, (addr, what, info) in list(p.calls.items()):
                if addr not in self.ctl.nodes:
                    self.calls.pop(cid, None)
                    self.pusher_reply(p, cid, OSError(f"{addr} dropped"))

    # -- the loop --------------------------------------------------------------------------------

    def ready(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for m in self.msgs:
            if m[0] <= self.now and not self._frozen(m[2]):
                out.append(("msg", m))
        for node in self.nodes.values():
            if not self.running(node.addr):
                continue
            for timer in ("next_forward", "next_write", "next_beat"):
                if getattr(node, timer) <= self.now:
                    out.append(("timer", (node, timer)))
        if self.next_tick <= self.now:
            out.append(("tick", None))
        for p in self.pushers:
            busy = p.current or p.log or self.pushes_started < self.total_pushes
            if not p.calls and busy and p.next_act <= self.now:
                out.append(("pusher", p))
        return out

    def _frozen(self, dst: str) -> bool:
        node = self.nodes.get(dst)
        return node is not None and node.frozen_until is not None and dst not in self.crashed

    def advance(self) -> None:
        times = [m[0] for m in self.msgs if not self._frozen(m[2])]
        times += [rec.deadline for rec in self.calls.values()]
        times += [n.frozen_until for n in self.nodes.values() if n.frozen_until is not None]
        times.append(self.next_tick)
        times += [p.next_act for p in self.pushers if not p.calls]
        for node in self.nodes.values():
            if self.running(node.addr):
                times += [node.next_forward, node.next_write, node.next_beat]
        later = [t for t in times if t > self.now]
        self.now = min(later) if later else self.now + 0.1

    def step(self) -> None:
        for node in self.nodes.values():
            if node.frozen_until is not None and node.frozen_until <= self.now:
                node.frozen_until = None
                self.log(f"thaw {node.addr}")
        for cid, rec in list(self.calls.items()):
            if rec.deadline <= self.now:
                self.seqno += 1
                err = TimeoutError("no answer")
                self.msgs.append((self.now, self.seqno, rec.caller, "reply", cid, err))
                rec.deadline = float("inf")
        self.pusher_guard()
        if self.fault_budget > 0 and self.rng.random() < 0.01:
            self.fault()
        choices = self.ready()
        if not choices:
            self.advance()
            return
        kind, x = self.rng.choice(choices)
        if kind == "msg":
            self.msgs.remove(x)
            self.deliver(x)
        elif kind == "timer":
            node, timer = x
            self.spend(node)
            if timer == "next_forward":
                node.next_forward = self.now + FORWARD_INTERVAL
                self.node_handle(node, ForwardDue())
            elif timer == "next_write":
                node.next_write = self.now + WRITE_INTERVAL
                self.node_handle(node, WriteDue())
            else:
                node.next_beat = self.now + BEAT_INTERVAL
                beat = Beat(None, node.addr, node.key, self.now, node.state.heartbeat())
                self.request(node.addr, "ctl", "beat", beat)
        elif kind == "tick":
            self.next_tick = self.now + TICK_INTERVAL
            self.ctl_handle(Tick(self.now))
        elif kind == "pusher":
            x.next_act = self.now + self.rng.choice([0.002, 0.02, 0.1])
            self.pusher_act(x)

    # -- invariants ------------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        tail = "\n".join(self.trace[-400:])
        raise SimulationFailure(
            f"seed {self.seed}: {what}\n(replay: adam_dask.ps.simulation.simulate({self.seed}, "
            f"trace=True))\n--- trace (last 400 steps) ---\n{tail}"
        )

    def holders(self, sid: int) -> set[str]:
        hs = set(self.ctl.routing.get(sid, ()))
        rnd = self.ctl.rounds.get(sid)
        if rnd is not None:
            hs |= rnd.waiting | set(rnd.replies)
        for op in self.ctl.ops.values():
            if sid in op.sids and op.kind == "promote":
                hs.add(op.addr)
        return {a for a in hs if self.alive(a)}

    def check(self) -> None:
        dirty, self.dirty = self.dirty, set()
        for addr in dirty:
            if addr in self.crashed:
                continue
            for sid, st in self.nodes[addr].state.shards.items():
                if st.values.max(initial=0) > 1 or st.values.min(initial=0) < 0:
                    self.fail(f"{addr} holds a push of shard {sid} twice: {st.values}")
        self.check_manifest()
        if not dirty and not self.changed:
            return
        self.changed = False
        m = self.manifests[-1]
        n = self.total_pushes
        for sid in range(self.n_shards):
            holders = self.holders(sid)
            if not holders:
                continue  # every copy lost: the restore accounts for what goes
            ok = self.acked_mask[sid] & ~self.lost_mask[sid]
            ok &= self.blocks[m["blocks"][sid]][0] != 1
            if not ok.any():
                continue
            for h in self._held(sid):
                ok[h.push_id] = False
            for a in holders:
                st = self.nodes[a].state.shards.get(sid)
                if st is not None:
                    ok &= st.values[:n] != 1
            if ok.any():
                k = int(np.flatnonzero(ok)[0])
                self.fail(f"acknowledged push {k} of shard {sid} is lost (holders {holders})")

    def check_manifest(self) -> None:
        if len(self.manifests) == self.checked_manifests:
            return
        self.checked_manifests = len(self.manifests)
        m = self.manifests[-1]
        if len(self.manifests) > 1:
            prev = self.manifests[-2]
            if m["sequence"] <= prev["sequence"]:
                self.fail(f"manifest sequence went from {prev['sequence']} to {m['sequence']}")
            for s in range(self.n_shards):
                a = (prev["generations"][s], prev["versions"][s])
                b = (m["generations"][s], m["versions"][s])
                if b < a:
                    self.fail(f"manifest went back for shard {s}: {a} -> {b}")
        for s, path in enumerate(m["blocks"]):
            if path not in self.blocks:
                self.fail(f"the manifest names {path}, which is not there")
            if self.blocks[path][1] != m["versions"][s]:
                self.fail(f"the manifest names {path} at another version")

    def settled(self) -> bool:
        if self.pushes_started < self.total_pushes or any(
            p.current or p.calls or p.log for p in self.pushers
        ):
            return False
        if not self.ctl.healthy() or self.ctl.ops:
            return False
        m = self.manifests[-1]
        for sid, holders in self.ctl.routing.items():
            states = [self.nodes[a].state.shards.get(sid) for a in holders]
            if any(st is None for st in states):
                return False
            if len({st.position for st in states}) != 1:
                return False
            if m["versions"][sid] != states[0].version:
                return False
        return True

    def status(self) -> str:
        positions = {
            sid: {a: getattr(self.nodes[a].state.shards.get(sid), "position", None) for a in h}
            for sid, h in self.ctl.routing.items()
        }
        pushers = {p.name: (p.current, len(p.calls), len(p.log)) for p in self.pushers}
        return (
            f"healthy={self.ctl.healthy()} ops={list(self.ctl.ops.values())} "
            f"positions={positions} manifest={self.manifests[-1]['versions']} "
            f"pushers={pushers} started={self.pushes_started}/{self.total_pushes}"
        )

    def final_check(self) -> None:
        for sid, holders in self.ctl.routing.items():
            states = [self.nodes[a].state.shards[sid] for a in holders]
            for st in states[1:]:
                if not np.array_equal(st.values, states[0].values):
                    self.fail(f"copies of shard {sid} differ at the end")
            values = states[0].values
            for k, shards in self.acked.items():
                if sid in shards and values[k] != 1 and k not in self.lost_ok.get(sid, ()):
                    self.fail(f"acknowledged push {k} of shard {sid} missing at the end")


def simulate(
    seed: int,
    *,
    faults: bool = True,
    ack: str | None = None,
    steps: int = 6000,
    trace: bool = False,
) -> dict:
    """Run the simulation of ``seed`` (see the module doc); returns a summary. Raises
    :class:`SimulationFailure` with the seed and the trace when an invariant breaks; with
    ``trace``, prints the trace as it goes (to replay a failing seed). ``ack`` forces the
    pushers' acknowledgement mode (drawn from the seed by default)."""
    quiet = logging.getLogger("adam_dask.ps")
    level = quiet.level
    if not trace:
        quiet.setLevel(logging.CRITICAL)
    try:
        sim = _Sim(seed, faults, ack)
        for i in range(steps):
            sim.step()
            sim.check()
            if trace and sim.trace:
                print("\n".join(sim.trace))
                sim.trace.clear()
            if i > steps // 2 and sim.fault_budget > 0:
                sim.fault_budget = 0
            if sim.fault_budget == 0 and sim.settled():
                break
        else:
            sim.fail(f"the system did not settle in {steps} steps: {sim.status()}")
        sim.final_check()
        return {
            "seed": seed,
            "nodes": sim.n_nodes,
            "shards": sim.n_shards,
            "pushes": len(sim.acked),
            "ack": sim.ack,
            "lost_with_all_copies": sum(len(v) for v in sim.lost_ok.values()),
            "restored": len(sim.ctl.restored),
            "seconds": sim.now,
        }
    finally:
        quiet.setLevel(level)
