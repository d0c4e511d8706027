"""How messages reach the parts of the PS simulation, and what its pushers do (a
:class:`Traffic` acts in a :class:`~adam_dask.testing.sim_world.World` it holds): a node's
answer reaches the incarnation that asked, no other; a pusher
(:class:`~adam_dask.testing.sim_pusher.Pusher`) is a client handle on the simulated network and
clock that does what the client's courier does, in the same order, because it runs the same
plans (:mod:`~adam_dask.ps.protocol.courier_plan`: make room under its byte budget, replay
what moved, push; the settler's rounds), one request at a time, each walked to its primaries
by the client's :class:`~adam_dask.ps.protocol.request.Delivery` over the pusher's
:class:`~adam_dask.ps.protocol.routing.Routing`, what the primaries acknowledged kept in its
:class:`~adam_dask.ps.protocol.replay.ReplayLog`. When its pushes and settler rounds come is
the simulation's draw.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from ..errors import ShardUnavailable
from ..ps.protocol.courier_plan import (
    Ask,
    Deliver,
    Done,
    GiveUp,
    Pushing,
    Replay,
    Replaying,
    Settling,
    Shed,
    Wait,
)
from ..ps.protocol.mark import Mark
from ..ps.protocol.messages import (
    Beat,
    CallDone,
    CallFailed,
    Confirmed,
    ForwardDone,
    ForwardDue,
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
from ..ps.protocol.node_requests import (
    ConfirmedRequest,
    PushRequest,
    node_request,
    request_from_wire,
)
from ..ps.protocol.replay import HeldPush
from ..ps.protocol.request import Delivery, Refresh, Request, Send, part_of
from .sim_pusher import Pusher
from .sim_world import (
    FAILOVER_TIMEOUT,
    CallRecord,
    SimNode,
    World,
    brief,
)

logger = logging.getLogger(__name__)

__all__ = ["Traffic"]


def share_mark(k: int, rounds: int) -> Mark | None:
    """Push ``k``'s mark: with ``rounds``, replica ``k % rounds``'s share of synchronous step
    ``k // rounds`` (the server optimizer takes a step's shares as one round); else none."""
    if not rounds:
        return None
    return Mark(0, k % rounds, k // rounds, 0, 1, rounds, None, synchronous=True)


class Traffic:
    """Delivery of the world's messages and the pushers' moves (``w``: the world they act in)."""

    def __init__(self, w: World) -> None:
        self.w = w
        self.room_made = 0  # pushes that waited for room in their pusher's byte budget
        self.shed_pushes: dict[int, set[int]] = {}  # shard -> pushes a pusher let go of

    # -- delivery --------------------------------------------------------------------------------

    def deliver(self, msg: tuple) -> None:
        _, _, dst, kind, cid, x = msg
        if dst == "sched":
            self.scheduler_message(kind, x)
        elif dst == "ctl":
            self.to_controller(kind, cid, x)
        elif dst.startswith("pusher"):
            rec = self.w.calls.pop(cid, None)
            if rec is not None:
                self.pusher_reply(self.w.pushers[int(dst[6:])], cid, x)
        else:
            self.to_node(dst, kind, cid, x)

    def scheduler_message(self, kind: str, x: Any) -> None:
        if kind == "create":
            x, give_up = x
            if x not in self.w.ctl.workers or x in self.w.crashed:
                return  # the controller hears of the worker's loss, which ends the creation
            old = self.w.nodes.get(x)
            if old is not None and old.frozen_until is not None:
                # the worker cannot start an actor while frozen: it does when it wakes, unless
                # the plugin gave up waiting for it first (then the controller hears NodeFailed)
                if old.frozen_until <= give_up:
                    self.w.log(f"  create on {x} waits: the worker is frozen")
                    self.w.send(
                        "sched", "create", 0, (x, give_up), delay=old.frozen_until - self.w.now
                    )
                else:
                    self.w.send("sched", "create-failed", 0, x, delay=give_up - self.w.now)
                return
            self.w.nodes[x] = self.w._make_node(x)  # a new actor (an old one there is no member)
            self.w.nodes[x].next_beat = self.w.now
            # the answer to the node's start travels to the plugin as its first beat does:
            # either may reach the controller first
            key = self.w.nodes_key(x)
            self.w.send("sched", "ready", 0, (x, key), delay=self.w.start_rng.choice([0.0, 0.3]))
        elif kind == "ready":
            x, key = x
            self.w.log(f"  node ready {x} ({key})")
            self.w.ctl_handle(NodeReady(x, key, self.w.now))
        elif kind == "create-failed":
            self.w.log(f"  no node on {x}: the worker stayed frozen")
            self.w.ctl_handle(NodeFailed(x, "TimeoutError: the actor did not start"))
        elif kind == "removed":
            self.w.ctl_handle(WorkerRemoved(x, self.w.now))
        elif kind == "added":
            self.w.log(f"  worker {x} joins")
            self.w.ctl_handle(WorkerAdded(x, f"host-{x}", self.w.now))
        elif kind == "manifest":
            seq, doc = x
            if self.w.now < self.w.outage_until:
                self.w.ctl_handle(ManifestFailed(seq, "outage", self.w.now))
                return
            self.w.manifests.append(doc)
            self.w.log(f"  manifest {seq}: {doc['versions']} gens {doc['generations']}")
            self.w.ctl_handle(ManifestDone(seq))
        elif kind == "manifest-failed":
            self.w.ctl_handle(ManifestFailed(x, "outage", self.w.now))

    def to_controller(self, kind: str, cid: int, x: Any) -> None:
        if kind == "reply":
            rec = self.w.calls.pop(cid, None)
            if rec is None:
                return
            self.w.log(f"  ctl op {rec.info} answered: {brief(x)}")
            if isinstance(x, BaseException):
                self.w.ctl_handle(CallFailed(rec.info, repr(x)))
            else:
                self.w.ctl_handle(CallDone(rec.info, x))
            return
        what, ev = x
        if what == "report":
            self.w.ctl_handle(WriteReport(cid, ev.addr, ev.blocks))
        elif what == "beat":
            self.w.ctl_handle(Beat(cid, ev.addr, ev.key, self.w.now, ev.positions))

    def to_node(self, addr: str, kind: str, cid: int, x: Any) -> None:
        node = self.w.nodes.get(addr)
        if node is None or addr in self.w.crashed:
            if kind == "request":
                self.w.reply(cid, OSError(f"{addr} is gone"))
            return
        self.spend(node)
        if kind == "reply":
            rec = self.w.calls.get(cid)
            if rec is None or rec.caller_key != node.key:
                return  # an answer to an incarnation that is gone
            del self.w.calls[cid]
            self.node_reply(node, rec, x)
            return
        rec = self.w.calls.get(cid)
        if rec is not None and rec.callee_key is not None and rec.callee_key != node.key:
            self.w.reply(cid, ValueError(f"no actor {rec.callee_key} on {addr}"))
            return
        what, ev = x
        if what == "replicate":
            self.w.node_handle(node, Replicate(cid, ev.sender, ev.snaps))
        elif what in ("push", "confirmed"):
            self.to_primary(node, cid, *ev)
        elif what == "command":
            method, args = ev
            if method == "restore":
                self.restore(node, cid, *args)
            else:
                self.w.node_handle(node, command(method, cid, args))

    def to_primary(self, node: SimNode, cid: int, ev: Push | Confirmed, urgent: bool) -> None:
        """A pusher's push or question, as the node's runtime takes it: ``urgent`` (the pusher
        waits for room, or holds past half its budget), the node forwards at once after it."""
        if isinstance(ev, Push):
            self.w.node_handle(node, Pushes((dataclasses.replace(ev, req=cid),)))
        else:
            self.w.node_handle(node, Confirmed(cid, ev.sids))
        if urgent:
            self.w.node_handle(node, ForwardDue())

    def restore(
        self, node: SimNode, cid: int, sid: int, gen: int, start: int, stop: int, block: tuple
    ) -> None:
        path = block[0]
        if path not in self.w.blocks:
            self.w.reply(cid, FileNotFoundError(path))
            return
        values, version, _, ids, state, marks = self.w.blocks[path]
        # what went with every copy: pushes made so far (an answer may still be on its way)
        # that the block lacks and no pusher holds
        held = {h.push_id for h in self._held(sid)}
        in_block = self.w.held_pushes(values, ids)
        for k in range(self.w.pushes_started):
            if not in_block >> k & 1 and k not in held:
                self.w.lost_ok.setdefault(sid, set()).add(k)
                self.w.lost_bits[sid] |= 1 << k
        self.w.log(
            f"  restore shard {sid} on {node.addr} from {path}; lost {sorted(self.w.lost_ok.get(sid, ()))}"
        )
        state = None if state is None else state.copy()
        restore = Restore(cid, sid, gen, start, stop, version, values.copy(), ids, marks, state)
        self.w.node_handle(node, restore)

    def node_reply(self, node: SimNode, rec: CallRecord, x: Any) -> None:
        if rec.kind == "replicate":
            if node.forwards.get(rec.callee) is not None:
                node.forwards.pop(rec.callee, None)
            if isinstance(x, BaseException):
                self.w.node_handle(node, ForwardFailed(rec.callee, repr(x)))
            else:
                done = ForwardDone(rec.callee, x.held, x.refused, rec.callee_key)
                self.w.node_handle(node, done)
        elif rec.kind == "report":
            if isinstance(x, BaseException):
                self.w.node_handle(node, WriteFailed(repr(x)))
            else:
                self.w.node_handle(node, WriteDone(x.accepted, x.refused))
        elif rec.kind == "beat":
            if not isinstance(x, BaseException):
                self.w.node_handle(node, HeartbeatReply(x.member, x.gens))

    def spend(self, node: SimNode) -> None:
        """A retired node that woke up takes a few more steps, then its worker closes."""
        if node.doomed_after is not None and node.frozen_until is None:
            node.doomed_after -= 1
            if node.doomed_after < 0:
                self.w.log(f"  {node.addr} closes")
                self.w.crashed.add(node.addr)
                self.w.changed = True

    # -- pushers ---------------------------------------------------------------------------------

    def _held(self, sid: int) -> list[HeldPush]:
        return [h for p in self.w.pushers for h in p.log.held(sid)]

    def onehot(self, k: int) -> np.ndarray:
        """Push ``k``'s values over the whole server: 1 at index ``k`` of every shard."""
        d = np.zeros(self.w.n_shards * self.w.total_pushes, np.float32)
        d[k :: self.w.total_pushes] = 1
        return d

    def new_plan(self, p: Pusher) -> Pushing | Settling | Replaying | None:
        """What the pusher does next when nothing is under way, as the client's callers and
        its settler thread make it: a push given up, pushed again (its id kept); the held
        pushes of moved shards replayed, whatever comes next; a new push; or a round of the
        settler while pushes are held."""
        if not p.log:
            p.settler = None  # the client's settler ends when nothing is held
        if p.retry is not None:
            req, p.retry = p.retry, None
            return p.plans.push(req)
        if p.log.next_replay(p.routing.primaries(), self.w.shards) is not None:
            return p.plans.replay()
        if self.w.pushes_started < self.w.total_pushes and self.w.rng.random() < 0.6:
            k = self.w.pushes_started
            self.w.pushes_started += 1
            self.w.log(f"{p.name} starts push {k}")
            sids = tuple(range(self.w.n_shards))
            mark = share_mark(k, self.w.rounds)
            return p.plans.push(Request("push", sids, k, self.w.ack, mark, values=self.onehot(k)))
        if p.log and self.w.rng.random() < 0.5:
            if p.settler is None:
                p.settler = p.plans.settle(self.w.now)
            return p.settler
        return None

    def pusher_next(self, p: Pusher) -> Request | None:
        """Carry out the pusher's plan (a new one when none is under way) up to the next
        request to deliver; None: nothing to send now. The settler's wait between rounds is
        the simulation's draw of when its next round comes."""
        while True:
            if p.plan is None:
                p.plan = self.new_plan(p)
                if p.plan is None:
                    return None
            step = p.plan.next(self.w.now)
            if isinstance(step, (Replay, Ask, Deliver)):
                return step.request
            if isinstance(step, Refresh):
                p.routing.set(self.w.ctl.routing_info())
            elif isinstance(step, Shed):
                self.shed(p, step)
            elif isinstance(step, GiveUp):
                self.w.log(f"{p.name} {type(p.plan).__name__.lower()} gives up: {step.error}")
                self.abandon(p)
                return None
            elif isinstance(step, Wait) and p.plan is not p.settler:
                p.next_act = max(p.next_act, self.w.now + step.seconds)
                return None
            else:  # done, or a round of the settler over
                if isinstance(step, Done) and p.plan is p.settler:
                    p.settler = None
                p.plan = None

    def abandon(self, p: Pusher) -> None:
        """The pusher's plan ended in an error, as the client's callers see it: a push is
        pushed again (with its id), the settler starts over."""
        if isinstance(p.plan, Pushing):
            p.retry = p.plan.request
        if p.plan is p.settler:
            p.settler = None
        p.plan = None

    def shed(self, p: Pusher, step: Shed) -> None:
        """The plan lets go of what every copy holds (``step``): the pushes let go of are noted
        (lost with every copy of their shard, nothing replays them)."""
        held = {(s, h.push_id) for s in p.log.shards() for h in p.log.held(s)}
        if not p.log.shed(step.below, step.primaries):
            return
        gone = held - {(s, h.push_id) for s in p.log.shards() for h in p.log.held(s)}
        for sid, k in gone:
            self.shed_pushes.setdefault(sid, set()).add(k)
        self.w.log(f"{p.name} sheds {sorted(gone)}: the checkpoint is behind")

    def pusher_act(self, p: Pusher) -> None:
        """One move of the pusher: read the routing when its :class:`Delivery` asked to, take
        the next request of its plan when none is under way, then send what the delivery's
        plan says."""
        if p.refresh:
            p.refresh = False
            p.routing.set(self.w.ctl.routing_info())
        if p.delivery is None:
            req = self.pusher_next(p)
            if req is None:
                return
            p.delivery = Delivery(req, p.routing, self.w.now, FAILOVER_TIMEOUT)
        d = p.delivery
        try:
            actions = d.plan(self.w.now)
        except ShardUnavailable as exc:
            # the client gives this request up, and with it the plan it was a step of
            self.w.log(f"{p.name} {d.request.op} gives up: {exc}")
            p.delivery = None
            self.abandon(p)
            return
        if not actions:
            self.pusher_done(p)
            return
        if isinstance(actions[0], Refresh):
            p.refresh = True
            p.next_act = max(p.next_act, self.w.now + actions[0].wait)
            return
        req = d.request
        for send in actions:
            assert isinstance(send, Send)
            stamps = p.routing.stamps(send.sids)
            # the request as the transports write it and the node reads it back
            head = node_request(req, send.sids, stamps, "sim", self.w.shards)
            head = request_from_wire(head.to_wire())
            ev: Any
            if isinstance(head, PushRequest):
                parts = {s: part_of(req, self.w.shards[s], s) for s in send.sids}
                deltas = {s: None if v is None else v.copy() for s, v in parts.items()}
                ev = head.event(None, deltas, False)
            elif isinstance(head, ConfirmedRequest):
                ev = head.event(None)
            else:  # pragma: no cover - the simulated pushers push and ask, nothing else
                raise AssertionError(f"the simulation sends no {req.op!r}")
            key = p.routing.key(send.addr)
            cid = self.w.request(p.name, send.addr, req.op, (ev, head.urgent), key=key)
            p.calls[cid] = (send.addr, send.sids)

    def pusher_reply(self, p: Pusher, cid: int, x: Any) -> None:
        """An answer (or the failure of a call) reaches the pusher's :class:`Delivery`, and
        its replay log as it reaches the client's."""
        self.w.changed = True
        addr, sids = p.calls.pop(cid)
        d = p.delivery
        assert d is not None
        req = d.request
        if isinstance(x, BaseException):
            d.failed(addr, sids, x)
        else:
            d.answered(addr, sids, x)

            def hold(sid: int, gen: int, version: int) -> HeldPush:
                part = part_of(req, self.w.shards[sid], sid)
                nbytes = 0 if part is None else part.nbytes
                return HeldPush(req.push_id, "push", part, addr, gen, version, nbytes, req.mark)

            p.log.answered(req, addr, x, hold)
        if d.done and not p.calls:
            self.pusher_done(p)

    def pusher_done(self, p: Pusher) -> None:
        d = p.delivery
        assert d is not None
        p.delivery = None
        req = d.request
        if isinstance(p.plan, Pushing) and req is p.plan.request:  # the push, its plan's end
            self.room_made += p.plan.made_room
            p.plan = None
        if req.op == "push" and "replay" not in req.args:
            k = req.push_id
            self.w.acked[k] = set(range(self.w.n_shards))
            for sid in range(self.w.n_shards):
                self.w.acked_bits[sid] |= 1 << k
            self.w.log(f"{p.name} push {k} acknowledged")

    def pusher_guard(self) -> None:
        """A pusher gives up calls to nodes the controller dropped (the client polls it)."""
        nodes = self.w.ctl.nodes
        for p in self.w.pushers:
            if not p.calls:
                continue
            for cid, (addr, _) in list(p.calls.items()):
                if addr not in nodes:
                    self.w.calls.pop(cid, None)
                    self.pusher_reply(p, cid, OSError(f"{addr} dropped"))
