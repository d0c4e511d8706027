"""A pusher of the PS simulation (:mod:`adam_dask.testing.simulation`): a client handle on the
simulated network and clock, with the client's routing, replay log and courier's plans; and
the byte budget its plans hold the pushes within.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from ..ps.protocol.courier_plan import CourierPlan, Pushing, Replaying, Settling
from ..ps.protocol.replay import ReplayLog
from ..ps.protocol.request import Delivery, Request
from ..ps.protocol.routing import Routing

logger = logging.getLogger(__name__)

__all__ = ["REPLAY_BYTES", "Pusher", "drawn_replay_bytes"]

REPLAY_BYTES = 64 << 20  # adam.ps.replay-bytes' default: more than a simulated pusher holds


def drawn_replay_bytes(seed: int, size: int) -> int:
    """The pushers' ``adam.ps.replay-bytes`` in the simulation of ``seed`` (a model of ``size``
    floats): in a quarter of the seeds 2 to 4 pushes of the whole model, so that pushes make
    room; else the default. Drawn apart from the seed's stream, so that a seed whose pushers
    never reach their budget runs as it would without one."""
    pick = random.Random(f"replay-bytes {seed}")
    return REPLAY_BYTES if pick.random() < 0.75 else pick.randint(2, 4) * 4 * size


@dataclass
class Pusher:
    """A client handle: its routing, its replay log, its courier's plans (``plans``: over
    both) and the plan and request under way."""

    name: str
    routing: Routing
    log: ReplayLog
    plans: CourierPlan
    plan: Pushing | Settling | Replaying | None = None  # the plan under way
    settler: Settling | None = None  # the settler's while pushes are held (a round at a time)
    delivery: Delivery | None = None  # the request under way
    calls: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # id -> Send
    refresh: bool = False  # read the routing before the next move
    retry: Request | None = None  # a push given up, to push again
    next_act: float = 0.0

    @classmethod
    def make(
        cls,
        name: str,
        shards: list[tuple[int, int]],
        budget: int,
        timeout: float,
        interval: float,
    ) -> Pusher:
        """A pusher named ``name`` over ``shards``, its plans within ``budget`` bytes, giving up
        after ``timeout`` seconds without progress (the primaries forward every
        ``interval``)."""
        routing, log = Routing("sim"), ReplayLog()
        plans = CourierPlan(log, routing, shards, budget, timeout, interval)
        return cls(name, routing, log, plans)

    @property
    def pushing(self) -> bool:
        """Whether a push is under way (its plan makes room, replays, or delivers it)."""
        return isinstance(self.plan, Pushing)
