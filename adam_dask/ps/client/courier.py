"""The courier of a parameter-server handle: every request (push, pull, a partition's range, the
offload's activations and errors, a replay, what every copy holds, the control calls) goes
through :meth:`Courier.deliver`, which routes it (:class:`~adam_dask.ps.protocol.request.Delivery`),
sends each primary its part on the data plane (:class:`~adam_dask.ps.plane.channels.PlaneCalls`) or,
where the plane can not reach a node and for control, as a Dask actor call
(:class:`~adam_dask.ps.client.control.DaskCalls`), waits for the answers, and retries on the new
primary after a fail-over with the same push id.

With ``ack="replay"`` the courier keeps what the primaries acknowledged (the
:class:`~adam_dask.ps.protocol.replay.ReplayLog`, a lease on the pushed segment rather than a copy)
until every copy and the checkpoint hold it. What it does with the held pushes (make room under
the byte budget, shed, replay to a new primary before the next request, ask what every copy
holds, give up) is the pure plan's (:mod:`~adam_dask.ps.protocol.courier_plan`); the courier
carries its steps out (:meth:`Courier.run`) and keeps settling in a thread of its own while
pushes are held, so they are replayed even when the pusher pushes nothing more.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any

import numpy as np

from ... import config
from ...errors import ShardUnavailable
from ..plane.channels import Channel, Channels, PlaneCalls, Segment
from ..protocol.courier_plan import (
    Ask,
    CourierPlan,
    Done,
    GiveUp,
    Pushing,
    Replay,
    Replaying,
    Settling,
    Shed,
    Wait,
    replay_budget,
)
from ..protocol.replay import HeldPush, ReplayLog
from ..protocol.replies import NodeReply, PullReply, PushReply
from ..protocol.request import Delivery, Outer, Refresh, Request, Send, part_of
from ..protocol.routing import Routing
from .control import Control, DaskCalls

logger = logging.getLogger(__name__)

__all__ = ["Courier"]


class Courier:
    """Routing, transports and replay log of one handle (see the module doc)."""

    def __init__(
        self,
        server_id: str,
        size: int,
        shards: list[tuple[int, int]],
        client: Any,
        optimizer: Any = None,
    ):
        self.server_id = server_id
        self.size = int(size)
        self.shards = shards
        self.routing = Routing(server_id)
        self.control = Control(server_id, client)
        self.dask = DaskCalls(self.control, shards)
        self.log = ReplayLog()
        self.channels: Channels | None = None
        self.plane: PlaneCalls | None = None
        self.lock = threading.RLock()  # one request at a time on this handle's channels
        # read once, where the handle is made (or unpickled in a task): a push reads none
        self.call_timeout = float(config.get("ps.call-timeout"))
        self.plane_timeout = float(config.get("ps.plane-timeout"))
        self.failover_timeout = float(config.get("ps.failover-timeout"))
        self.forward_interval = float(config.get("ps.forward-interval"))
        budget = replay_budget(int(config.get("ps.replay-bytes")), self.size)
        timeouts = (self.failover_timeout, self.forward_interval)
        self.plan = CourierPlan(self.log, self.routing, shards, budget, *timeouts)
        self.answered_at = -1e9  # monotonic time of the last push answered
        # {sid: the version this handle last read on the data plane}: with the server
        # optimizer's ``staleness``, each push names them (it counts the versions a shard
        # moved since)
        self.staleness = bool(getattr(optimizer, "staleness", False))
        self.read_versions: dict[int, int] = {}
        self._settler: threading.Thread | None = None
        self._shed_count = 0
        self._shed_logged = -60.0

    # -- transports ------------------------------------------------------------------------------

    def channels_or_none(self) -> Channels | None:
        """The data plane's channels (None with ``adam.ps.data-plane: dask``)."""
        mode = str(config.get("ps.data-plane"))
        if mode == "dask":
            return None
        if self.channels is None:
            timeout = self.plane_timeout
            tls = self.control.tls_context
            self.channels = Channels(self.server_id, self.size, mode, timeout, tls)
            self.plane = PlaneCalls(self.channels, self.shards)
        return self.channels

    def _channel(self, channels: Channels, addr: str) -> Channel | None:
        key = self.routing.key(addr)

        def endpoint() -> dict:
            fut = self.control.start(addr, key, "plane", timeout=self.call_timeout)
            return self._node_answer(addr, fut, self.call_timeout)

        return channels.get(addr, key, endpoint)

    def refresh(self) -> None:
        self.routing.set(self.control.routing())

    # -- one request -----------------------------------------------------------------------------

    def deliver(self, req: Request, call_timeout: float | None = None) -> Delivery:
        """Carry ``req`` to the primaries of its shards until each answered (see the module
        doc); returns the finished :class:`Delivery` (its ``results`` and ``replies``)."""
        if self.control.closed:
            raise ShardUnavailable(f"parameter server {self.server_id} is closed")
        timeout = self.call_timeout if call_timeout is None else float(call_timeout)
        with self.lock:
            if not self.routing.known:
                self.refresh()
            d = Delivery(req, self.routing, time.monotonic(), self.failover_timeout)
            try:
                while True:
                    actions = d.plan(time.monotonic())
                    if not actions:
                        return d
                    if isinstance(actions[0], Refresh):
                        time.sleep(actions[0].wait)
                        self.refresh()
                        continue
                    self._exchange(d, [a for a in actions if isinstance(a, Send)], timeout)
            finally:
                own = req.args.pop("own_segment", None)
                if own is not None:
                    own.release()

    def _exchange(self, d: Delivery, sends: list[Send], timeout: float) -> None:
        """Send every primary its part, then take the answers as they come."""
        req = d.request
        started: list[tuple[Send, Any, Any, Any]] = []
        seg = None
        channels = self.channels_or_none() if req.data else None
        if req.op == "push" and self.staleness and self.read_versions:
            req.bases = dict(self.read_versions)
        for send in sends:
            ch = None
            stamps = self.routing.stamps(send.sids)
            try:  # a node that does not give its endpoint fails as one that does not answer
                ch = self._channel(channels, send.addr) if channels is not None else None
                if ch is not None:
                    assert self.plane is not None
                    if seg is None and ch.unix:
                        seg = self.plane.segment_of(req)
                    target = self.plane.send(ch, req, send.sids, stamps, seg)
                    started.append((send, ch, target, None))
                else:
                    key = self.routing.key(send.addr)
                    fut = self.dask.start(send.addr, key, req, send.sids, stamps, timeout)
                    started.append((send, None, None, fut))
            except OSError as exc:
                if ch is not None:
                    self._plane_failed(send.addr, ch, req, seg)
                d.failed(send.addr, send.sids, exc)
        for send, ch, target, fut in started:
            try:
                reply = self._answer(send.addr, req, ch, target, fut, timeout)
            except Exception as exc:
                if ch is not None:
                    self._plane_failed(send.addr, ch, req, seg)
                if fut is not None:
                    fut.cancel()
                d.failed(send.addr, send.sids, exc)
                continue
            d.answered(send.addr, send.sids, reply)
            self._on_answer(req, send.addr, reply, seg)

    def _answer(
        self, addr: str, req: Request, ch: Channel | None, target: Any, fut: Any, timeout: float
    ) -> NodeReply:
        """Wait for ``addr``'s answer up to ``timeout``, giving up early when the controller
        drops ``addr`` (a dead or frozen worker: waiting for it would only time out)."""
        t0 = time.monotonic()
        step = self.plane_timeout
        while True:
            if ch is not None and ch.readable(step):
                assert self.plane is not None
                if req.data:
                    self._count(req, "plane")
                return self.plane.receive(ch, req, target)
            if fut is not None:
                try:
                    reply = fut.result(timeout=step)
                except TimeoutError:
                    pass
                else:
                    if req.data:
                        self._count(req, "dask")
                    return self.dask.finish(req, reply)
            self._still_waiting(addr, t0, timeout)

    def _node_answer(self, addr: str, fut: Any, timeout: float) -> Any:
        """The answer of a node's control call (``fut``), waited for as :meth:`_answer` waits
        (a dead node's address may take Dask's connect timeout to fail: the routing says so
        sooner)."""
        t0 = time.monotonic()
        while True:
            try:
                return fut.result(timeout=self.plane_timeout)
            except TimeoutError:
                self._still_waiting(addr, t0, timeout)
            except Exception:
                fut.cancel()
                raise

    def _still_waiting(self, addr: str, t0: float, timeout: float) -> None:
        """Go on waiting for ``addr`` (since ``t0``): raises once ``timeout`` passed or the
        controller dropped ``addr`` (a dead or frozen worker: waiting would only time out)."""
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"no answer from the PS node on {addr} in {timeout}s")
        self.refresh()
        if addr not in self.routing.nodes:
            raise OSError(f"the PS worker {addr} was dropped by the controller")

    def _count(self, req: Request, transport: str) -> None:
        if self.channels is None:
            return
        c = self.channels.counts
        if req.op == "push":
            c["pushes"] += 1
        elif req.op == "pull":
            c["pulls"] += 1
        if transport == "dask":
            c["to_dask"] += 1

    def _plane_failed(self, addr: str, ch: Channel, req: Request, seg: Segment | None) -> None:
        assert self.channels is not None
        out = req.args.get("out")
        pulled = self.channels.pool.of(out) if out is not None else None
        self.channels.fail(addr, self.routing.key(addr), ch, seg, pulled)

    def _on_answer(self, req: Request, addr: str, reply: NodeReply, seg: Segment | None) -> None:
        """Keep what a primary acknowledged (``ack="replay"``), drop what it says is durable;
        note the versions read (a pull's, or a push's pull)."""
        read = None
        if not self.staleness:
            pass
        elif isinstance(reply, PullReply):
            read = reply.versions
        elif isinstance(reply, PushReply):
            read = reply.pulled_versions
        if read:
            self.read_versions.update(read)
        self.log.answered(
            req, addr, reply, lambda sid, gen, v: self._held(req, sid, addr, gen, v, seg)
        )
        if req.op == "push":
            self.answered_at = time.monotonic()

    def _held(
        self, req: Request, sid: int, addr: str, gen: int, version: int, seg: Segment | None
    ) -> HeldPush:
        """Shard ``sid``'s part of ``req`` as the log keeps it: a lease on the segment the
        values were sent from (no copy), else a copy; the offload's activations and errors."""
        if req.outer is not None:
            o = req.outer
            part = Outer(
                o.offset, o.out, o.inp, o.scale, o.errors, o.activations, {sid: o.cols[sid]}
            )
            nbytes = o.errors.nbytes + o.activations.nbytes
            return HeldPush(req.push_id, "push_outer", part, addr, gen, version, nbytes, req.mark)
        a, b = self.shards[sid]
        values = part_of(req, (a, b), sid)
        if seg is None and self.channels is not None and req.base == 0:
            seg = self.channels.pool.of(req.values)  # a pool buffer sent over TCP
        lease = None
        if values is None:
            payload = None
        elif seg is not None and req.values is seg.array:
            assert self.channels is not None
            self.channels.pool.hold(seg)
            payload, lease = seg.array[a:b], seg
        else:
            payload = values.copy()
        nbytes = 0 if payload is None else payload.nbytes
        return HeldPush(
            req.push_id, "push", payload, addr, gen, version, nbytes, req.mark, lease=lease
        )

    def send_push(self, req: Request) -> Delivery:
        """One push through the courier, as its plan says (:class:`Pushing`: room made in the
        replay log, held pushes of moved shards replayed, the push delivered and kept until
        durable with ``ack="replay"``). A push with ``pull`` reads its shards back into
        ``args["out"]`` (from ``args["out_base"]`` on) in the same round trip; those a node
        did not send back (the Dask transport's) are pulled after."""
        try:
            d = self.run(self.plan.push(req))
        finally:
            own = req.args.pop("own_segment", None)  # the deliver did not get to it
            if own is not None:
                own.release()
        assert d is not None
        if req.ack == "replay":
            self.keep_settling()
        if req.pull:
            pulled = d.pulled()
            missing = tuple(s for s in req.sids if s not in pulled)
            if missing:
                self.pull(missing, req.args["out"], req.args.get("out_base", 0))
        return d

    def pull(self, sids: tuple[int, ...], out: np.ndarray, base: int = 0) -> None:
        """Read shards ``sids`` into ``out`` (the parameters from ``base`` on), after the held
        pushes of moved shards went to their new primaries (a pull sees this handle's own
        pushes)."""
        self.replay_moved()
        self.deliver(Request("pull", sids, args={"out": out, "out_base": base}))

    def run(self, plan: Pushing | Settling | Replaying) -> Delivery | None:
        """Carry out ``plan``'s steps (:mod:`~adam_dask.ps.protocol.courier_plan`) until it is
        done; returns the :class:`Delivery` of its push, if it has one. A step's request that
        fails raises, and so does the plan's :class:`GiveUp`."""
        pushed = None
        while True:
            step = plan.next(time.monotonic())
            if isinstance(step, Done):
                return pushed
            if isinstance(step, Refresh):
                self.refresh()
            elif isinstance(step, Shed):
                self.shed(step)
            elif isinstance(step, Wait):
                time.sleep(step.seconds)
            elif isinstance(step, GiveUp):
                raise step.error
            elif isinstance(step, Replay):
                logger.info(
                    "server %s: replaying push %x to the new primary of shard %d",
                    self.server_id,
                    step.request.push_id,
                    step.request.sids[0],
                )
                self.deliver(step.request)
            elif isinstance(step, Ask):
                self.deliver(step.request)
            else:
                pushed = self.deliver(step.request)

    def ask_nodes(self, method: str, *args: Any) -> dict[str, Any]:
        """{addr: answer, or the error's repr} of ``method(*args)`` on every node the routing
        names, all at once (control: stats, stories)."""
        calls = {a: (k, method, *args) for a, k in self.routing.nodes.items()}
        answers = self.control.each(calls, self.call_timeout)
        return {a: (r if not isinstance(r, BaseException) else repr(r)) for a, r in answers.items()}

    def flush(self, timeout: float, checkpoint: bool, copies: int) -> dict[int, int]:
        """Wait for a running fail-over (up to the fail-over timeout), replay what moved, then
        have every primary wait until its copies (and ``checkpoint``) hold its shards; returns
        {shard: version} flushed."""
        deadline = time.monotonic() + timeout
        wait_heal = time.monotonic() + min(timeout, self.failover_timeout)
        while True:
            self.refresh()
            if self.routing.healthy or time.monotonic() > wait_heal:
                break
            time.sleep(0.1)
        if not self.routing.healthy:
            logger.warning(
                "server %s: flushing with fewer than %d copies of some shards (a "
                "PS worker is missing)",
                self.server_id,
                copies,
            )
        self.replay_moved()
        remaining = max(deadline - time.monotonic(), 1.0)
        req = Request(
            "flush",
            tuple(range(len(self.shards))),
            args={"limit": remaining, "checkpoint": checkpoint},
        )
        return self.deliver(req, call_timeout=remaining + 5).results

    # -- holding ---------------------------------------------------------------------------------

    def replay_moved(self) -> None:
        """Send the held pushes of shards whose primary changed to the new primary (same push
        ids: a push the survivors or the checkpoint already hold is applied once)."""
        self.run(self.plan.replay())

    def shed(self, step: Shed) -> None:
        """Let go of the held pushes every copy holds that wait for the checkpoint alone, as
        ``step`` says (the write-back is behind: a storage outage, or a slow store); say so
        once a minute."""
        gone = self.log.shed(step.below, step.primaries)
        if not gone:
            return
        self._shed_count += gone
        now = time.monotonic()
        if now - self._shed_logged >= 60.0:  # once a minute in an outage
            self._shed_logged = now
            logger.warning(
                "server %s: the checkpoint is behind; %d push(es) every copy holds are no longer "
                "kept against the loss of all copies (adam.ps.replay-bytes)",
                self.server_id,
                self._shed_count,
            )
            self._shed_count = 0

    def settle(self, *, copies_only: bool = False, limit: float | None = None) -> None:
        """Until every held push is durable (``copies_only``: until every copy holds each one,
        the checkpoint may lag), as :class:`Settling` says: :class:`ShardUnavailable` after the
        fail-over timeout without progress while some copy still lacks a push; ``limit``:
        seconds in all before :class:`TimeoutError`."""
        self.run(self.plan.settle(time.monotonic(), copies_only=copies_only, limit=limit))

    def keep_settling(self) -> None:
        """Pushes are held: make sure the settler thread runs."""
        if self.log and (self._settler is None or not self._settler.is_alive()):
            self._settler = threading.Thread(
                target=contextvars.copy_context().run,
                args=(self._settle_in_background,),
                name=f"adam-settle-{self.server_id}",
                daemon=True,
            )
            self._settler.start()

    def _settle_in_background(self) -> None:
        """Settle while pushes are held (so they are replayed after a fail-over even when no
        more pushes come); ends when every held push is durable or the server is closed."""
        interval = self.forward_interval
        while self.log and not self.control.closed:
            time.sleep(interval)
            if time.monotonic() - self.answered_at < interval:
                continue  # pushes flow: their answers confirm the held ones (no calls needed)
            try:
                self.settle()
            except KeyError as exc:
                if "no parameter server" not in str(exc):
                    logger.warning("server %s: replaying held pushes: %r", self.server_id, exc)
                    continue
                logger.info(
                    "server %s was closed; %d held push(es) no longer replayed",
                    self.server_id,
                    len(self.log),
                )
                return
            except Exception as exc:
                if self.control.closed:
                    return
                logger.warning(
                    "server %s: %d held push(es) not confirmed yet (%s); still trying",
                    self.server_id,
                    len(self.log),
                    exc,
                )

    def close(self) -> None:
        """The server is closed: the held pushes are let go (nowhere to replay them) and the
        data plane's connections and segments closed."""
        self.control.closed = True
        self.log.clear()
        if self.channels is not None:
            self.channels.close()
