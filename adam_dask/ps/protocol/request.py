"""One request to the parameter server and its way to the primaries, pure (no sockets, no
Dask, no clocks of its own): the part of the client that routes, retries across fail-overs and
gives up, written once for every kind of call and driven by the client's transports
(:mod:`adam_dask.ps.client`) or by the simulation's network (:mod:`adam_dask.testing.simulation`).

A :class:`Request` names its shards and what it carries: ``push`` (a delta per shard, or the
dense offload's activations and errors), ``pull`` (the shards' values), ``push`` with
``pull`` (both, one round trip per primary), ``confirmed`` (what every copy holds: the replay
log's question), and the control calls ``flush``, ``marks``, ``versions``. A push carries its
id: sent again to a new primary after a fail-over (or replayed from the log), it is applied
once.

:class:`Delivery` walks a request to the primaries: :meth:`Delivery.plan` says whom to send
which shards now (:class:`Send`), or that the routing must be read again first
(:class:`Refresh`, after a node moved a shard, failed or was dropped, or while a shard has no
primary); :meth:`Delivery.answered` and :meth:`Delivery.failed` take what came back. It ends
when every shard was answered, and raises :class:`ShardUnavailable` when a shard has no copy
left or no primary answered within the fail-over timeout, and the node's own refusal
(:class:`UpdateRejected`: nothing applied) at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError, ShardUnavailable, StorageError, UpdateRejected
from .replies import NodeReply, PushReply

logger = logging.getLogger(__name__)

__all__ = [
    "DATA_OPS",
    "Delivery",
    "Outer",
    "Refresh",
    "Request",
    "Send",
    "overlapping",
    "part_of",
    "write_pulled",
]

DATA_OPS = ("push", "pull", "confirmed")  # what travels on the data plane; the rest is control

# answers of a node, not signs of a lost one: asking again, or elsewhere, can not help
_FINAL = (UpdateRejected, ConfigError, StorageError, ShardUnavailable)


def overlapping(shards: list[tuple[int, int]], start: int, stop: int) -> list[int]:
    """The shards with a value in ``[start, stop)``."""
    return [s for s, (a, b) in enumerate(shards) if a < stop and b > start]


@dataclass(frozen=True, slots=True)
class Outer:
    """The dense offload's update: ``scale * errors.T @ activations`` added at ``offset`` to an
    ``(out, inp)`` row-major matrix; each shard gets the error columns ``cols[sid]`` of the rows
    that touch it and computes its part where it is stored."""

    offset: int
    out: int
    inp: int
    scale: float
    errors: Any  # (B, out) float32
    activations: Any  # (B, inp) float32
    cols: dict[int, tuple[int, int]]


@dataclass(slots=True)
class Request:
    """One call to the primaries of ``sids``.

    ``values``: a push's flat float32 source (the whole server's, or ``base`` onward: a
    partition's span), with ``nonzero[sid]`` False for a shard whose part is all zeros (the
    push is recorded there, nothing added); ``outer`` instead for the offload; ``pull``: read
    the shards back too; ``urgent``, ``bases``: see
    :class:`~adam_dask.ps.protocol.node_requests.PushRequest`. ``args`` carry what never
    crosses a wire as it is: a control call's arguments, where pulled values go (``out``,
    ``out_base``), the client's own marks (``replay``, ``own_segment``)."""

    op: str
    sids: tuple[int, ...]
    push_id: int = 0
    ack: str = "replay"
    mark: Any = None
    values: Any = None
    base: int = 0
    nonzero: Any = None
    outer: Outer | None = None
    pull: bool = False
    urgent: bool = False  # the pusher waits for room: the primaries forward at once
    bases: dict[int, int] | None = None  # {sid: the version last read}: the staleness
    args: dict = field(default_factory=dict)

    @property
    def data(self) -> bool:
        return self.op in DATA_OPS


@dataclass(frozen=True, slots=True)
class Send:
    """Send the request's part for ``sids`` to the primary at ``addr``."""

    addr: str
    sids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Refresh:
    """Read the routing again before going on (``wait``: seconds to wait first)."""

    wait: float = 0.0


class Delivery:
    """The way of one :class:`Request` to its primaries (see the module doc).

    ``routing`` is the client's :class:`~adam_dask.ps.protocol.routing.Routing` (read, never written
    here); ``now`` and ``timeout`` set the deadline (``adam.ps.failover-timeout``)."""

    def __init__(self, request: Request, routing: Any, now: float, timeout: float):
        self.request = request
        self.routing = routing
        self.todo = set(request.sids)
        self.replies: dict[str, list[NodeReply]] = {}  # addr -> its answers
        self.results: dict[int, Any] = {}  # sid -> the node's per-shard answer
        self.deadline = now + float(timeout)
        self.refresh = False  # the routing must be read before the next send
        self.last_error: BaseException | None = None
        self._wait = 0.0
        self._generation = routing.generation

    @property
    def done(self) -> bool:
        return not self.todo

    def plan(self, now: float) -> list[Send | Refresh]:
        """What to do now: nothing (done), a :class:`Refresh`, or one :class:`Send` per
        primary."""
        if not self.todo:
            return []
        lost = [s for s in sorted(self.todo) if self.routing.is_lost(s)]
        if lost:
            raise ShardUnavailable(
                f"every copy of shard {lost[0]} of server {self.routing.server_id} is lost and "
                "there is no checkpoint to rebuild it from",
                "create the server with checkpoint=URL",
                shard=lost[0],
            )
        prim = self.routing.primaries()
        waiting = [s for s in sorted(self.todo) if s not in prim]
        if (waiting or self.refresh) and now > self.deadline:
            s = waiting[0] if waiting else min(self.todo)
            raise ShardUnavailable(
                f"server {self.routing.server_id}: {self.request.op} could not reach the primary "
                f"of shard {s}" + (f" ({self.last_error})" if self.last_error else ""),
                "check the PS workers (adam.ps.failover-timeout)",
                shard=s,
            ) from self.last_error
        if self.refresh or waiting:
            # back off while the controller has not changed the routing yet
            unchanged = self.routing.generation == self._generation
            self._wait = min(max(self._wait * 2, 0.02), 0.5) if unchanged else 0.0
            self._generation = self.routing.generation
            self.refresh = False
            return [Refresh(self._wait)]
        groups: dict[str, list[int]] = {}
        for s in sorted(self.todo):
            groups.setdefault(prim[s][0], []).append(s)
        return [Send(addr, tuple(sids)) for addr, sids in groups.items()]

    def answered(self, addr: str, sids: tuple[int, ...], reply: NodeReply) -> None:
        """``addr`` answered the part for ``sids``: its shards are done but those it says moved
        (another generation, not primary there), which go again after a refresh."""
        self.replies.setdefault(addr, []).append(reply)
        per_shard = reply.per_shard
        for s in sids:
            if s in per_shard:
                self.results[s] = per_shard[s]
                self.todo.discard(s)
        if any(s in self.todo for s in sids):  # moved, or not answered: the routing again
            self.refresh = True

    def pulled(self) -> set[int]:
        """The shards whose values came back with the answers to a push (a push with a pull
        on the data plane)."""
        return {
            s
            for rs in self.replies.values()
            for r in rs
            if isinstance(r, PushReply)
            for s in r.pulled or ()
        }

    def failed(self, addr: str, sids: tuple[int, ...], exc: BaseException) -> None:
        """The call to ``addr`` failed (no answer in time, connection lost, the node gone):
        its shards go again after a refresh. A node's refusal is raised as it is."""
        if isinstance(exc, _FINAL):
            raise exc
        logger.debug(
            "server %s: %s on %s failed (%r); refreshing the routing",
            self.routing.server_id,
            self.request.op,
            addr,
            exc,
        )
        self.last_error = exc
        self.refresh = True


def part_of(req: Request, shard: tuple[int, int], sid: int) -> np.ndarray | None:
    """Shard ``sid``'s part of a push's values (None: all zeros); a shard the values cover in
    part (a partition's span) gets zeros outside them."""
    if req.nonzero is not None and not req.nonzero[sid]:
        return None
    a, b = shard
    lo, hi = a - req.base, b - req.base
    values = req.values
    if lo >= 0 and hi <= values.shape[0]:
        return values[lo:hi]
    part = np.zeros(b - a, np.float32)
    s0, s1 = max(lo, 0), min(hi, values.shape[0])
    part[s0 - lo : s1 - lo] = values[s0:s1]
    return part


def write_pulled(req: Request, shard: tuple[int, int], values: np.ndarray) -> None:
    """Write a shard's pulled ``values`` into the request's ``out`` (which covers ``out_base``
    onward: the whole server, or a partition's span)."""
    a, b = shard
    out, base = req.args["out"], int(req.args.get("out_base", 0))
    lo, hi = max(a, base), min(b, base + out.shape[0])
    if lo < hi:
        out[lo - base : hi - base] = values[lo - a : hi - a]
