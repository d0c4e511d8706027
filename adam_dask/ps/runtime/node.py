"""PSNode: the parameter-server actor, one per PS worker and server.

The protocol lives in :class:`~adam_dask.ps.protocol.node_state.NodeState` (pure); this actor only
carries its actions out on the worker's event loop: it answers callers, sends forwards to
backups, writes checkpoint blocks (in a thread) and reports them to the controller, and runs
three timers (forward, write-back, heartbeat). All methods are ``async``: they run on the
worker's event loop and touch the state from one thread, without locks; the pushes that arrive
during one turn of the loop are applied as one batch.

The controller (the scheduler plugin, :mod:`adam_dask.ps.runtime.plugin`) makes the nodes, tells them
which shards they hold and in which role, and hears their heartbeats; a node that stops hearing
it is a member stops serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from ...errors import ShardUnavailable, StorageError
from ..plane.server import PlaneServer, plane_server
from ..protocol.messages import (
    AddBackups,
    Assign,
    Cancel,
    Drop,
    Fence,
    Flush,
    Forward,
    ForwardDue,
    HeartbeatReply,
    Marks,
    Promote,
    Push,
    Pushes,
    Replicate,
    Reply,
    Restore,
    SetBackups,
    Versions,
    WriteBlocks,
    WriteDue,
)
from ..protocol.node_machine import handle
from ..protocol.node_requests import (
    ConfirmedRequest,
    PullRequest,
    PushRequest,
    request_from_wire,
)
from ..protocol.node_state import NodeState
from ..protocol.optimizer import ServerOptimizer
from ..protocol.replies import (
    BeatReply,
    ConfirmedReply,
    MarksReply,
    PullReply,
    PushReply,
    ReplicateReply,
    VersionsReply,
)
from ..protocol.shard import ShardCopy
from .background import every, spawn
from .forwarder import Forwarder
from .node_plane import Answer, NodePlane
from .stimuli import stimulus, validating
from .writeback import WriteBack

logger = logging.getLogger(__name__)

__all__ = ["PSNode"]


class PSNode:
    """The shards one PS worker holds for one server (a Dask actor).

    Parameters
    ----------
    server_id : str
        The server this node belongs to.
    config : dict
        ``forward_interval``, ``writeback_interval``, ``heartbeat_interval``, ``retry_base``,
        ``retry_max``, ``forward_retry_max``, ``call_timeout``, ``dedup_window``,
        ``checkpoint`` (URL or None), ``storage_options``.
    """

    def __init__(self, server_id: str, config: dict):
        self.server_id = server_id
        self.cfg = dict(config)
        self.key: str | None = None
        self.state: NodeState | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._reqs = itertools.count()
        self._validate = validating()  # adam.ps.validate: check the invariants each event
        self._queue: list[Push] = []
        self._drain_scheduled = False
        self._timers: list[asyncio.Task] = []
        self._worker: Any = None
        self._closed = False
        self._started = time.time()
        self._plane: PlaneServer | None = None
        self._forwarder: Forwarder | None = None  # forwards to the backups
        self._writeback: WriteBack | None = None  # the checkpoint's write-back (when there is one)
        # the state is the event loop's and the data plane's threads': one at a time
        self._lock = threading.RLock()
        # pushes and pulls served, by transport (the data plane's sockets, or Dask actor
        # calls), and the dense offload's outer products computed (either transport)
        self.counts = {"plane": 0, "dask": 0, "outer_products": 0}
        self._entry: NodePlane | None = None  # the data plane's way in

    def __repr__(self) -> str:
        return f"PSNode({self.server_id}, {self.state!r})"

    # -- plumbing --------------------------------------------------------------------------------

    def _start(self) -> NodeState:
        if self.state is not None:
            return self.state
        from distributed import get_worker

        self._worker = get_worker()
        ckpt = self.cfg.get("checkpoint")
        self.state = NodeState(
            self._worker.address,
            dedup_window=self.cfg["dedup_window"],
            checkpoint=bool(ckpt),
            optimizer=ServerOptimizer.from_dict(self.cfg.get("optimizer")),
        )
        if ckpt:
            self._writeback = WriteBack(self.server_id, self._worker, self.cfg, self._handle)
        self._plane = plane_server(self._worker)
        self._entry = NodePlane(
            self.state, self._lock, self._worker, self.cfg, self._do, self.counts
        )
        self._plane.register(self.server_id, self._entry)
        self._forwarder = Forwarder(self.server_id, self._worker, self.cfg, self._handle)
        timers = [("forward_interval", self._forward_tick), ("heartbeat_interval", self._heartbeat)]
        timers += [("writeback_interval", self._write_tick)] if ckpt else []
        who = f"node {self._worker.address}"
        self._timers = [
            spawn(every(self.cfg[k], fn, lambda: not self._closed, who)) for k, fn in timers
        ]
        return self.state

    def _do(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Reply) and isinstance(a.req, Answer):  # a data-plane request
                a.req.set(a.value)
            elif isinstance(a, Reply):
                fut = self._futures.pop(a.req, None)
                if fut is None or fut.done():
                    continue
                if isinstance(a.value, BaseException):
                    fut.set_exception(a.value)
                else:
                    fut.set_result(a.value)
            elif isinstance(a, Forward):
                assert self._forwarder is not None
                self._forwarder.start(a)
            elif isinstance(a, Cancel):
                assert self._forwarder is not None
                self._forwarder.cancel(a.addr or "")
            elif isinstance(a, WriteBlocks):
                assert self._writeback is not None
                spawn(self._writeback.write(a.snaps, a.stimulus_id))
            else:  # pragma: no cover - every action of NodeState is handled above
                raise TypeError(f"unknown node action {a!r}")

    def _handle(self, event: Any) -> None:
        state = self._start()
        with self._lock:
            actions = handle(state, event, validate=self._validate)
        self._do(actions)

    async def _ask(self, make: Any, stimulus_id: str = "") -> Any:
        """Feed the event ``make(req)`` (caused by ``stimulus_id``, when given) and wait for
        its reply."""
        state = self._start()
        req = next(self._reqs)
        fut = asyncio.get_running_loop().create_future()
        self._futures[req] = fut
        event = make(req)
        if stimulus_id:
            event = replace(event, stimulus_id=stimulus_id)
        with self._lock:
            actions = handle(state, event, validate=self._validate)
        self._do(actions)
        try:
            return await fut
        finally:
            self._futures.pop(req, None)

    # -- timers ----------------------------------------------------------------------------------

    async def _forward_tick(self) -> None:
        self._handle(ForwardDue(stimulus_id=stimulus("forward-due")))

    async def _write_tick(self) -> None:
        if self._writeback is not None and self._writeback.due():
            self._handle(WriteDue(stimulus_id=stimulus("write-due")))

    async def _heartbeat(self) -> None:
        if self.key is None or self.state is None:
            return
        try:
            reply = await asyncio.wait_for(
                self._worker.scheduler.adam_ps_heartbeat(
                    server_id=self.server_id,
                    addr=self._worker.address,
                    key=self.key,
                    positions={s: list(p) for s, p in self._locked(self.state.heartbeat).items()},
                ),
                self.cfg["call_timeout"],
            )
        except (OSError, TimeoutError) as exc:
            logger.info("node %s: heartbeat failed (%s)", self._worker.address, exc)
            return
        beat = BeatReply.from_wire(reply)
        cause = stimulus("heartbeat-reply")
        self._handle(HeartbeatReply(beat.member, beat.gens, stimulus_id=cause))

    # -- commands from the controller ------------------------------------------------------------

    async def start(self, key: str) -> None:
        """Compile the kernels (in a thread: the loop keeps answering), then start the timers;
        ``key`` is this actor's key (it names the node in heartbeats)."""
        from ..protocol.shard_kernels import warm_up

        await asyncio.to_thread(warm_up)
        self.key = key
        self._start()

    async def assign(
        self,
        shards: dict,
        gens: dict,
        primaries: dict | None = None,
        version: int = 0,
        *,
        stimulus_id: str = "",
    ) -> None:
        """Hold ``shards`` {sid: (start, stop)} at ``gens``; be primary of ``primaries``."""
        shards = {int(s): (int(a), int(b)) for s, (a, b) in shards.items()}
        gens = {int(s): int(g) for s, g in gens.items()}
        prim = {int(s): [tuple(p) for p in ps] for s, ps in (primaries or {}).items()}
        await self._ask(lambda r: Assign(r, shards, gens, prim, int(version)), stimulus_id)

    async def load(
        self, values: dict, versions: dict, marks: dict | None = None, states: dict | None = None
    ) -> None:
        """Initial values of held shards at ``versions`` (a new or restored server), with the
        data positions (``marks`` {sid: [Mark]}) and the optimizer's state (``states``
        {sid: momentum}) they hold."""
        state = self._start()
        with self._lock:
            state.load({int(s): v for s, v in values.items()}, versions, marks, states)

    async def fence(self, gens: dict, *, stimulus_id: str = "") -> dict:
        gens = {int(s): int(g) for s, g in gens.items()}
        return await self._ask(lambda r: Fence(r, gens), stimulus_id)

    async def promote(self, shards: dict, stamp: int = 0, *, stimulus_id: str = "") -> dict:
        shards = {int(s): (int(g), [tuple(p) for p in ps]) for s, (g, ps) in shards.items()}
        return await self._ask(lambda r: Promote(r, shards, int(stamp)), stimulus_id)

    async def restore(
        self, sid: int, gen: int, start: int, stop: int, block: Any, *, stimulus_id: str = ""
    ) -> int:
        """Become the primary of ``sid``, rebuilt from the checkpoint block ``block`` =
        (path, generation, version)."""
        self._start()
        if self._writeback is None:
            raise ShardUnavailable(f"shard {sid}: no checkpoint to restore it from")
        b = await asyncio.to_thread(self._writeback.store.read_snapshot, block[0])
        return await self._ask(
            lambda r: Restore.of_block(r, int(sid), int(gen), start, stop, b), stimulus_id
        )

    async def set_backups(self, shards: dict, stamp: int = 0, *, stimulus_id: str = "") -> None:
        shards = {int(s): [tuple(p) for p in ps] for s, ps in shards.items()}
        await self._ask(lambda r: SetBackups(r, shards, int(stamp)), stimulus_id)

    async def add_backups(self, shards: dict, stamp: int = 0, *, stimulus_id: str = "") -> dict:
        shards = {int(s): [tuple(p) for p in ps] for s, ps in shards.items()}
        return await self._ask(lambda r: AddBackups(r, shards, int(stamp)), stimulus_id)

    async def drop(self, sids: Iterable[int], *, stimulus_id: str = "") -> None:
        await self._ask(lambda r: Drop(r, tuple(int(s) for s in sids)), stimulus_id)

    async def close(self) -> None:
        """Stop the timers and forwards (called before the actor is released)."""
        self._closed = True
        if self._plane is not None:
            self._plane.unregister(self.server_id, self._entry)
        for t in self._timers:
            t.cancel()
        if self._forwarder is not None:
            self._forwarder.close()

    # -- update path -----------------------------------------------------------------------------

    async def call(self, wire: dict, payload: Any = None) -> dict:
        """A data-path request as the Dask transport carries it (``adam.ps.data-plane:
        dask``): a :mod:`~adam_dask.ps.protocol.node_requests` header with its values beside it
        (a push's {sid: values}, a part of zeros left out; the offload's ({sid: its error
        columns}, activations)), answered as the data plane answers, every field carried (the
        staleness ``bases``, ``urgent``, a pull's versions). A push's ``pull`` is not answered
        here: the reply names no shard pulled, and the pusher pulls them itself."""
        state = self._start()
        self.counts["dask"] += 1
        r = request_from_wire(wire)
        reply: PushReply | PullReply | ConfirmedReply
        if isinstance(r, PullRequest):
            reply = await self._ask(r.event)
        elif isinstance(r, ConfirmedRequest):
            reply = await self._ask(r.event)
        elif isinstance(r, PushRequest):
            deltas = {s: None if n < 0 else payload[s] for s, _, n in r.parts}
            reply = await self._push(r.event(None, deltas, False))
        else:
            cols, activations = payload
            self.counts["outer_products"] += 1
            todo = {int(s): e for s, e in cols.items() if state.accepts(int(s), r.stamps)}

            def compute() -> dict[int, np.ndarray | None]:
                return {
                    s: state.shards[s].outer_as_delta(
                        r.offset, r.out, r.inp, e, activations, r.scale
                    )
                    for s, e in todo.items()
                    if s in state.shards
                }

            deltas = await asyncio.to_thread(compute) if todo else {}
            moved = set(r.sids) - set(deltas)
            if deltas:
                res = await self._push(r.event(None, deltas, False))
                reply = replace(res, moved=tuple(sorted(set(res.moved) | moved)))
            else:
                reply = PushReply({}, tuple(sorted(moved)), confirmed={}, durable={})
        if (
            not isinstance(r, PullRequest) and r.urgent
        ):  # the pusher waits for room in its replay log: the backups get it now
            self._handle(ForwardDue())
        return reply.to_wire()

    async def _push(self, push: Push) -> PushReply:
        """Apply ``push`` (its ``req`` replaced) with the others of this turn of the loop."""
        self._start()
        fut = asyncio.get_running_loop().create_future()
        req = next(self._reqs)
        self._futures[req] = fut
        ack = push.ack or self.cfg["ack"]
        self._queue.append(replace(push, req=req, ack=ack))
        if not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)
        try:
            return await fut
        finally:
            self._futures.pop(req, None)

    def _drain(self) -> None:
        self._drain_scheduled = False
        items, self._queue = tuple(self._queue), []
        if items:
            self._handle(Pushes(items, stimulus_id=stimulus(f"push-{items[0].push_id}")))

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    async def plane(self) -> dict:
        """Where pushers reach this node's data plane (:mod:`adam_dask.ps.plane.server`)."""
        self._start()
        assert self._plane is not None
        return {"server_id": self.server_id, **self._plane.endpoint()}

    async def pull_versions(self, sids: Iterable[int]) -> dict:
        """``{"per_shard": {sid: version}, "moved": [...]}`` for the primaries among ``sids``."""
        reply: VersionsReply = await self._ask(
            lambda r: Versions(r, tuple(int(s) for s in sids), True)
        )
        return reply.to_wire()

    async def versions(self, sids: Iterable[int] | None = None) -> dict[int, int]:
        """{sid: version} of the shards held here (all, or ``sids``)."""
        sids_t = None if sids is None else tuple(int(s) for s in sids)
        return await self._ask(lambda r: Versions(r, sids_t))

    async def marks(self, sids: Iterable[int], epoch: int) -> dict:
        """``{"per_shard": {sid: {replica: Mark}}, "moved": [...]}``: the data positions of
        ``epoch`` the primaries among ``sids`` hold."""
        reply: MarksReply = await self._ask(
            lambda r: Marks(r, tuple(int(s) for s in sids), int(epoch))
        )
        return reply.to_wire()

    async def replicate(self, snaps: list[ShardCopy], sender: str = "") -> dict:
        """A forward from a primary: ``{"held": {sid: (gen, version)}, "refused": {sid: gen}}``."""
        reply: ReplicateReply = await self._ask(lambda r: Replicate(r, sender, tuple(snaps)))
        return reply.to_wire()

    async def flush(
        self, sids: Iterable[int] | None = None, limit: float | None = None, checkpoint: bool = True
    ) -> dict:
        """Wait until every backup (and, with a checkpoint and ``checkpoint``, the manifest)
        holds the current version of the primaries ``sids`` (all by default). Returns
        ``{"per_shard": {sid: version}, "durable": {sid: version the checkpoint holds too},
        "moved": [...]}``; after ``limit`` seconds raises :class:`StorageError` when the
        write-back is what is missing, else :class:`ShardUnavailable` (a backup is behind)."""
        sids_t = None if sids is None else tuple(int(s) for s in sids)
        reqs: list = []

        def flush(req: Any) -> Flush:
            reqs.append(req)
            return Flush(req, sids_t, checkpoint)

        try:
            reply: ConfirmedReply = await asyncio.wait_for(self._ask(flush), limit)
            return reply.to_wire()
        except TimeoutError:
            state = self.state
            missing = self._locked(state.abandon_flush, reqs[0]) if state and reqs else None
            if missing == "checkpoint":
                error = state.last_writeback_error if state else None
                last = f"last error: {' '.join(str(error).split())}" if error else "no answer"
                raise StorageError(
                    f"the checkpoint did not take the write-back of {self._worker.address} in "
                    f"{limit:.3g}s ({last})"
                ) from None
            raise ShardUnavailable(
                f"flush on {self._worker.address}: the copies did not confirm every push in "
                f"{limit:.3g}s",
                "check the PS workers",
            ) from None

    # -- introspection ---------------------------------------------------------------------------

    async def story(self, sid: int | None = None) -> list[dict]:
        """The node's story of shard ``sid`` (every shard: ``None``), oldest first: the events
        of note it handled, each with its stimulus id and the actions it led to."""
        state = self._start()
        return self._locked(lambda: [e.to_dict() for e in state.story(sid)])

    async def applied(self, sid: int) -> list[list[int]]:
        """``[version, push id]`` of the pushes shard ``sid`` remembers, in the order this
        copy's lineage applied them (``adam.ps.dedup-window`` of them; none held: [])."""
        st = self._start().shards.get(int(sid))
        return [] if st is None else self._locked(lambda: [[v, p] for v, p in st.ids_since(-1)])

    async def stats(self) -> dict:
        """Counters and lags of this node (see ParameterServer.stats)."""
        state = self._start()
        out = self._locked(state.stats)
        out["address"] = self._worker.address
        out["uptime"] = time.time() - self._started
        out["plane_forwards"] = self._forwarder.counts() if self._forwarder else None
        out["by_transport"] = {t: self.counts[t] for t in ("plane", "dask")}
        out["outer_products"] = self.counts["outer_products"]
        lag = out["writeback_lag_versions"]
        last = self._writeback.last_write if self._writeback is not None else time.time()
        out["writeback_lag_seconds"] = time.time() - last if lag > 0 else 0.0
        return out
