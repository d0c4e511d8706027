"""What a pusher does with the pushes it holds, pure (no threads, no sleeps, no Dask, no clock:
``now`` comes in): the policy of the client's :class:`~adam_dask.ps.client.courier.Courier`,
driven by it and by the simulation's pushers (:mod:`adam_dask.testing.sim_traffic`).

With ``ack="replay"`` a pusher keeps every acknowledged push until it is durable (the
:class:`~adam_dask.ps.protocol.replay.ReplayLog`). A plan reads that log and the pusher's
:class:`~adam_dask.ps.protocol.routing.Routing` and says, one :data:`Step` at a time, what to do
next; its runner carries each step out (reads the routing, delivers a request through
:class:`~adam_dask.ps.protocol.request.Delivery`, feeds the answers to the log, sleeps) and asks
for the next step with the time. A plan ends with :class:`Done` or :class:`GiveUp`.

* :class:`Pushing`, one push: **make room** under the byte budget (:func:`replay_budget`:
  ``adam.ps.replay-bytes``, never under two pushes of the whole model): read the routing and
  shed what waits for the checkpoint alone, then settle until there is room, asking urgently;
  the push asks its primaries to forward at once past half the budget (its own answer then
  confirms the pushes before it); **replay** the held pushes whose primary moved; **deliver**
  the push.
* :class:`Settling`, until the held pushes take at most ``below`` bytes (or every copy holds
  them): rounds of reading the routing, replaying what moved and asking the primaries what every
  copy holds (``confirmed``; urgent while waiting for room, after which the routing is read
  and what waits for the checkpoint alone is shed), then a wait. It gives up with
  :class:`ShardUnavailable` after the fail-over timeout without progress (the held bytes going
  down restarts it) while some copy still lacks a push, and keeps waiting where only the
  checkpoint is behind.
* :class:`Replaying`: the held pushes whose primary moved, to the new primary (same push ids),
  one request at a time, each made from the log just before it is sent.

:class:`CourierPlan` holds what every plan of one pusher reads (its log, routing, shards,
budget and fail-over timeout) and makes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...errors import ShardUnavailable
from .replay import ReplayLog
from .request import Refresh, Request

logger = logging.getLogger(__name__)

__all__ = [
    "Ask",
    "CourierPlan",
    "Deliver",
    "Done",
    "GiveUp",
    "Pushing",
    "Refresh",
    "Replay",
    "Replaying",
    "Settling",
    "Shed",
    "Step",
    "Wait",
    "replay_budget",
]

# seconds before the second round of a push waiting for room; while nothing is let go each
# wait doubles, to half the forward interval: a pusher waiting for slow copies (a loaded
# machine, a shard under repair) must not add its own load to the primaries and the controller
# (at 2 ms every round, two such pushers beside 3 busy processes per core kept the controller's
# repair and the forwards it waited for from ending: tests/ps/test_failover.py)
ROOM_WAIT = 0.002


def replay_budget(replay_bytes: int, size: int) -> int:
    """Bytes of held pushes before a push waits for room: ``replay_bytes``
    (``adam.ps.replay-bytes``), and never under two pushes of the whole model of ``size``
    floats (a large model keeps pushing on the plane)."""
    return max(int(replay_bytes), 2 * 4 * int(size))


@dataclass(frozen=True, slots=True)
class Shed:
    """Let go of the held pushes every copy holds (they wait for the checkpoint alone), oldest
    first, until at most ``below`` bytes are held, of the shards whose primary is still the one
    in ``primaries`` ({sid: (address, generation)}: the routing's when the plan decided;
    :meth:`ReplayLog.shed`)."""

    below: int
    primaries: dict[int, tuple[str, int]]


@dataclass(frozen=True, slots=True)
class Replay:
    """Deliver ``request``: a held push, to its shard's new primary (same push id and mark)."""

    request: Request


@dataclass(frozen=True, slots=True)
class Ask:
    """Deliver ``request``: the ``confirmed`` question (what every copy and the checkpoint
    hold of the shards with held pushes)."""

    request: Request


@dataclass(frozen=True, slots=True)
class Deliver:
    """Deliver ``request``: the push itself."""

    request: Request


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait ``seconds``, then ask for the next step."""

    seconds: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The plan ends with ``error``: the runner raises it."""

    error: Exception


@dataclass(frozen=True, slots=True)
class Done:
    """The plan is over."""


Step = Refresh | Shed | Replay | Ask | Deliver | Wait | GiveUp | Done


class CourierPlan:
    """What the plans of one pusher read: its ``log``, its ``routing`` (read, never written
    here), the ``shards`` ({sid: (start, stop)}), the ``budget`` in bytes
    (:func:`replay_budget`), the fail-over ``timeout`` (``adam.ps.failover-timeout``) and the
    primaries' forward ``interval`` (``adam.ps.forward-interval``: a settler waits half of it
    between rounds)."""

    def __init__(
        self,
        log: ReplayLog,
        routing: Any,
        shards: list[tuple[int, int]],
        budget: int,
        timeout: float,
        interval: float,
    ):
        self.log = log
        self.routing = routing
        self.shards = shards
        self.budget = int(budget)
        self.timeout = float(timeout)
        self.interval = float(interval)

    def push(self, request: Request) -> Pushing:
        """The plan of one push (see the module doc)."""
        return Pushing(self, request)

    def settle(
        self,
        now: float,
        *,
        below: int = 0,
        copies_only: bool = False,
        limit: float | None = None,
        read_at: float = -float("inf"),
    ) -> Settling:
        """Settle from ``now`` until at most ``below`` bytes are held (``copies_only``: until
        every copy holds each held push, the checkpoint may lag), waiting half the forward
        interval between rounds (waiting for room, ``below`` > 0: :data:`ROOM_WAIT`, doubled
        while nothing is let go, up to that), the routing read for the replays at most every
        half interval; ``limit``: seconds in all before a :class:`TimeoutError`; ``read_at``:
        when the routing was last read (a push that just read it does not read it again at once for
        its replays). While waiting for room, each round reads the routing again just before
        it sheds (see :class:`Pushing`); the rounds' waits bound how often."""
        return Settling(self, now, below, copies_only, limit, read_at)

    def replay(self) -> Replaying:
        """Replay the held pushes of moved shards (before a pull, a flush)."""
        return Replaying(self)

    def shed(self, below: int) -> Shed:
        """Let go of what waits for the checkpoint alone down to ``below`` bytes, in the shards
        whose held pushes did not move (those are replayed first)."""
        return Shed(below, self.routing.primaries())

    def push_bytes(self, request: Request) -> int:
        """What holding ``request`` costs at most: float32 values of its shards."""
        return 4 * sum(b - a for a, b in (self.shards[s] for s in request.sids))


class Replaying:
    """The held pushes whose shard has another primary now, sent to it one at a time."""

    def __init__(self, plan: CourierPlan):
        self.plan = plan

    def next(self, now: float) -> Replay | Done:
        p = self.plan
        req = p.log.next_replay(p.routing.primaries(), p.shards)
        return Done() if req is None else Replay(req)


_HEAD, _REPLAY, _ASKED, _SHED, _CHECK = range(5)


class Settling:
    """Rounds until the held pushes take at most ``below`` bytes (see the module doc and
    :meth:`CourierPlan.settle`)."""

    def __init__(
        self,
        plan: CourierPlan,
        now: float,
        below: int,
        copies_only: bool,
        limit: float | None,
        read_at: float = -float("inf"),
    ):
        self.plan = plan
        self.below = int(below)
        self.copies_only = copies_only
        self.limit = limit
        self.end = None if limit is None else now + float(limit)
        self.deadline = now + plan.timeout
        self.held = plan.log.nbytes
        self.first_wait = ROOM_WAIT if self.below > 0 else plan.interval / 2
        self.wait = self.first_wait
        self.read_at = read_at  # when the routing was last read
        self._replays = Replaying(plan)
        self._phase = _HEAD

    def wanted(self) -> bool:
        """Whether more is held than the plan settles for."""
        log = self.plan.log
        if not log or log.nbytes <= self.below:
            return False
        return not (self.copies_only and not log.unreplicated)

    def next(self, now: float) -> Step:
        log = self.plan.log
        if self._phase == _HEAD:
            if not self.wanted():
                return Done()
            if log.nbytes < self.held:  # progress: the fail-over timeout starts again
                self.held = log.nbytes
                self.deadline = now + self.plan.timeout
                self.wait = self.first_wait
            self._phase = _REPLAY
            if now - self.read_at >= self.plan.interval / 2:
                self.read_at = now
                return Refresh()
        if self._phase == _REPLAY:
            step = self._replays.next(now)
            if isinstance(step, Replay):
                return step
            self._phase = _ASKED
            question = log.question(urgent=self.below > 0)
            if question is not None:
                return Ask(question)
        if self._phase == _ASKED:
            self._phase = _CHECK
            if self.below > 0:  # waiting for room: what waits for the checkpoint alone goes,
                self._phase = _SHED  # decided on the routing read now (see Pushing)
                self.read_at = now
                return Refresh()
        if self._phase == _SHED:
            self._phase = _CHECK
            return self.plan.shed(self.below)
        self._phase = _HEAD
        return self._checked(now)

    def _checked(self, now: float) -> Step:
        """The end of a round: done, out of time, or a wait before the next."""
        log = self.plan.log
        if not self.wanted():
            return Done()
        if self.end is not None and now > self.end:
            return GiveUp(TimeoutError(f"{len(log)} held push(es) not durable in {self.limit}s"))
        if now > self.deadline:
            if not log.unreplicated:  # only the checkpoint is behind: keep waiting
                self.deadline = now + self.plan.timeout
                return self.next(now)
            sid = log.shards()[0]
            return GiveUp(
                ShardUnavailable(
                    f"server {self.plan.routing.server_id}: the copies of shard {sid} did not "
                    f"confirm {len(log)} acknowledged push(es) in time",
                    "check the PS workers (adam.ps.failover-timeout)",
                    shard=sid,
                )
            )
        wait, self.wait = self.wait, min(2 * self.wait, self.plan.interval / 2)
        return Wait(wait)


_ROOM, _SHED_FIRST, _SETTLE, _PUSH, _SENT = range(5)


class Pushing:
    """One push: room made, moved pushes replayed, the push delivered (see the module doc)."""

    def __init__(self, plan: CourierPlan, request: Request):
        self.plan = plan
        self.request = request
        self.made_room = False  # the push waited for room (shed, or settled under the budget)
        self._below = 0
        self._read_at = -float("inf")  # when this plan read the routing
        self._settling: Settling | None = None
        self._replays = Replaying(plan)
        self._phase = _ROOM if request.ack == "replay" else _PUSH

    def next(self, now: float) -> Step:
        p, log, req = self.plan, self.plan.log, self.request
        if self._phase == _ROOM:
            self._phase = _SETTLE
            self._below = max(p.budget - p.push_bytes(req), 0)
            if log.nbytes > self._below:
                # a shed reads the routing first: with a copy of it from before every copy of
                # a shard was lost, the pushes those copies held would look durable but for
                # the checkpoint, and go while the controller rebuilds the shard without them
                # (the simulation: seeds 10173, 16269, 27904, 40259, 86755 of 100,000)
                self.made_room = True
                self._phase = _SHED_FIRST
                self._read_at = now
                return Refresh()
        if self._phase == _SHED_FIRST:
            self._phase = _SETTLE
            return p.shed(self._below)
        if self._phase == _SETTLE:
            if self._settling is None and log.nbytes > self._below:
                self.made_room = True
                self._settling = p.settle(now, below=self._below, read_at=self._read_at)
            step = Done() if self._settling is None else self._settling.next(now)
            if not isinstance(step, Done):
                return step
            req.urgent = log.nbytes > p.budget // 2
            self._phase = _PUSH
        if self._phase == _PUSH:
            step = self._replays.next(now)
            if isinstance(step, Replay):
                return step
            self._phase = _SENT
            return Deliver(req)
        return Done()
