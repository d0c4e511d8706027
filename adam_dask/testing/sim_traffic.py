"""How messages reach the parts of the PS simulation, and what its pushers do (a mixin of
:class:`~adam_dask.testing.sim_world.World`): a node's answer reaches the incarnation that asked, no
other; a pusher is a client handle on the simulated network and clock, one request at a time,
each walked to its primaries by the client's :class:`~adam_dask.ps.protocol.request.Delivery` over the
pusher's :class:`~adam_dask.ps.protocol.routing.Routing`, what the primaries acknowledged kept in its
:class:`~adam_dask.ps.protocol.replay.ReplayLog` (which also makes its replays and questions).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ShardUnavailable
from ..ps.client.control import part_of
from ..ps.protocol.controller import ServerState
from ..ps.protocol.messages import (
    Beat,
    CallDone,
    CallFailed,
    Confirmed,
    ForwardDone,
    ForwardFailed,
    HeartbeatReply,
    ManifestDone,
    ManifestFailed,
    NodeFailed,
    NodeReady,
    Push,
    Pushes,
    Replicate,
    Restore,
    WorkerAdded,
    WorkerRemoved,
    WriteDone,
    WriteFailed,
    WriteReport,
)
from ..ps.protocol.node_commands import command
from ..ps.protocol.node_state import NodeState
from ..ps.protocol.replay import HeldPush, ReplayLog
from ..ps.protocol.request import Delivery, Refresh, Request, Send
from ..ps.protocol.routing import Routing

logger = logging.getLogger(__name__)

__all__ = ["Traffic"]


CALL_TIMEOUT = 30.0
FAILOVER_TIMEOUT = 60.0
FORWARD_INTERVAL = 0.25
WRITE_INTERVAL = 1.0
BEAT_INTERVAL = 0.25
BEAT_TIMEOUT = 2.0
RETIRE_TIMEOUT = 4.0
TICK_INTERVAL = 0.1


def _brief(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 160 else text[:157] + "..."


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
    """A client handle: its routing, its replay log and the request under way."""

    name: str
    routing: Routing = field(default_factory=lambda: Routing("sim"))
    log: ReplayLog = field(default_factory=ReplayLog)
    delivery: Delivery | None = None  # the request under way
    calls: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # id -> Send
    refresh: bool = False  # read the routing before the next move
    retry: Request | None = None  # a push given up, to deliver again
    next_act: float = 0.0


class Traffic:
    """Delivery of messages and the pushers' moves.

    A mixin: the state below and the plumbing methods after it are those of
    :class:`~adam_dask.testing.sim_world.World`, which sets and defines them.
    """

    rng: random.Random
    now: float
    n_shards: int
    shards: list[tuple[int, int]]
    total_pushes: int
    ack: str
    outage_until: float
    calls: dict[int, _Callrec]
    nodes: dict[str, _Node]
    crashed: set[str]
    blocks: dict[str, tuple[np.ndarray, int, int, tuple]]
    manifests: list[dict]
    acked: dict[int, set[int]]
    lost_ok: dict[int, set[int]]
    acked_bits: list[int]
    lost_bits: list[int]
    changed: bool
    pushes_started: int
    ctl: ServerState
    pushers: list[_Pusher]

    # -- plumbing (World's) ----------------------------------------------------------------------

    def log(self, text: str) -> None:
        raise NotImplementedError

    def nodes_key(self, addr: str) -> str:
        raise NotImplementedError

    def _make_node(self, addr: str) -> _Node:
        raise NotImplementedError

    def send(self, dst: str, kind: str, call: int, x: Any, delay: float | None = None) -> None:
        raise NotImplementedError

    def request(
        self, caller: str, callee: str, kind: str, event: Any, info: Any = None, key: Any = None
    ) -> int:
        raise NotImplementedError

    def reply(self, cid: int, value: Any) -> None:
        raise NotImplementedError

    def ctl_handle(self, event: Any) -> None:
        raise NotImplementedError

    def node_handle(self, node: _Node, event: Any) -> None:
        raise NotImplementedError

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
            x, give_up = x
            if x not in self.ctl.workers or x in self.crashed:
                return  # the controller hears of the worker's loss, which ends the creation
            old = self.nodes.get(x)
            if old is not None and old.frozen_until is not None:
                # the worker cannot start an actor while frozen: it does when it wakes, unless
                # the plugin gave up waiting for it first (then the controller hears NodeFailed)
                if old.frozen_until <= give_up:
                    self.log(f"  create on {x} waits: the worker is frozen")
                    self.send("sched", "create", 0, (x, give_up), delay=old.frozen_until - self.now)
                else:
                    self.send("sched", "create-failed", 0, x, delay=give_up - self.now)
                return
            self.nodes[x] = self._make_node(x)  # a new actor (an old one there is no member)
            self.nodes[x].next_beat = self.now
            self.log(f"  node ready {x} ({self.nodes[x].key})")
            self.ctl_handle(NodeReady(x, self.nodes_key(x), self.now))
        elif kind == "create-failed":
            self.log(f"  no node on {x}: the worker stayed frozen")
            self.ctl_handle(NodeFailed(x, "TimeoutError: the actor did not start"))
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
                self.lost_bits[sid] |= 1 << k
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
                self.changed = True

    # -- pushers ---------------------------------------------------------------------------------

    def _held(self, sid: int) -> list[HeldPush]:
        return [h for p in self.pushers for h in p.log.held(sid)]

    def onehot(self, k: int) -> np.ndarray:
        """Push ``k``'s values over the whole server: 1 at index ``k`` of every shard."""
        d = np.zeros(self.n_shards * self.total_pushes, np.float32)
        d[k :: self.total_pushes] = 1
        return d

    def pusher_next(self, p: _Pusher) -> Request | None:
        """The pusher's next request, as the client makes them: the held pushes of moved shards
        replayed first (before a push, and in each round of the settler), a new push, or a
        round of the settler (the routing read again, then a replay or the question of what
        every copy holds)."""
        if p.retry is not None:
            req, p.retry = p.retry, None
            return req
        replays = p.log.replays(p.routing.primaries(), self.shards)
        if replays:
            return replays[0]
        if self.pushes_started < self.total_pushes and self.rng.random() < 0.6:
            k = self.pushes_started
            self.pushes_started += 1
            self.log(f"{p.name} starts push {k}")
            sids = tuple(range(self.n_shards))
            return Request("push", sids, k, self.ack, values=self.onehot(k))
        if p.log and self.rng.random() < 0.5:
            p.routing.set(self.ctl.routing_info())  # the client's settler reads it every round
            replays = p.log.replays(p.routing.primaries(), self.shards)
            return replays[0] if replays else p.log.question()
        return None

    def pusher_act(self, p: _Pusher) -> None:
        """One move of the pusher's :class:`Delivery`: read the routing when it asked to,
        start the next request when none is under way, then send what its plan says."""
        if p.refresh:
            p.refresh = False
            p.routing.set(self.ctl.routing_info())
        if p.delivery is None:
            req = self.pusher_next(p)
            if req is None:
                return
            p.delivery = Delivery(req, p.routing, self.now, FAILOVER_TIMEOUT)
        d = p.delivery
        try:
            actions = d.plan(self.now)
        except ShardUnavailable as exc:
            # the client gives this request up; the pusher tries again (a push keeps its id)
            self.log(f"{p.name} {d.request.op} gives up: {exc}")
            p.delivery = None
            if d.request.op == "push" and "replay" not in d.request.args:
                p.retry = d.request
            return
        if not actions:
            self.pusher_done(p)
            return
        if isinstance(actions[0], Refresh):
            p.refresh = True
            p.next_act = max(p.next_act, self.now + actions[0].wait)
            return
        req = d.request
        for send in actions:
            assert isinstance(send, Send)
            stamps = p.routing.stamps(send.sids)
            ev: Any
            if req.op == "push":
                parts = {s: part_of(req, self.shards[s], s) for s in send.sids}
                deltas = {s: None if v is None else v.copy() for s, v in parts.items()}
                ev = Push(None, deltas, req.push_id, stamps, req.ack)
            else:
                ev = Confirmed(None, send.sids)
            cid = self.request(p.name, send.addr, req.op, ev, key=p.routing.key(send.addr))
            p.calls[cid] = (send.addr, send.sids)

    def pusher_reply(self, p: _Pusher, cid: int, x: Any) -> None:
        """An answer (or the failure of a call) reaches the pusher's :class:`Delivery`, and
        its replay log as it reaches the client's."""
        self.changed = True
        addr, sids = p.calls.pop(cid)
        d = p.delivery
        assert d is not None
        req = d.request
        if isinstance(x, BaseException):
            d.failed(addr, sids, x)
        else:
            d.answered(addr, sids, x)

            def hold(sid: int, gen: int, version: int) -> HeldPush:
                part = part_of(req, self.shards[sid], sid)
                return HeldPush(req.push_id, "push", part, addr, gen, version, 1)

            p.log.answered(req, addr, x, hold)
        if d.done and not p.calls:
            self.pusher_done(p)

    def pusher_done(self, p: _Pusher) -> None:
        d = p.delivery
        assert d is not None
        p.delivery = None
        req = d.request
        if req.op == "push" and "replay" not in req.args:
            k = req.push_id
            self.acked[k] = set(range(self.n_shards))
            for sid in range(self.n_shards):
                self.acked_bits[sid] |= 1 << k
            self.log(f"{p.name} push {k} acknowledged")

    def pusher_guard(self) -> None:
        """A pusher gives up calls to nodes the controller dropped (the client polls it)."""
        nodes = self.ctl.nodes
        for p in self.pushers:
            if not p.calls:
                continue
            for cid, (addr, _) in list(p.calls.items()):
                if addr not in nodes:
                    self.calls.pop(cid, None)
                    self.pusher_reply(p, cid, OSError(f"{addr} dropped"))
