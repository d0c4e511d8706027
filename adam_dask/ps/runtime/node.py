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
from typing import Any

import numpy as np

from ...errors import ShardUnavailable, StorageError
from ..plane.server import PlaneServer, plane_server
from ..protocol.messages import (
    AddBackups,
    Assign,
    Cancel,
    Confirmed,
    Drop,
    Fence,
    Flush,
    Forward,
    ForwardDue,
    HeartbeatReply,
    Marks,
    Promote,
    Pull,
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
from ..protocol.node_state import NodeState
from ..protocol.shard import Mark, Snapshot
from .background import spawn
from .forwarder import Forwarder
from .writeback import WriteBack

logger = logging.getLogger(__name__)

__all__ = ["PSNode"]


class _Answer:
    """The answer to one data-plane request (its request id in the state machine): set in the
    thread that applied it, or later on the event loop (``ack="all"`` waits for the forwards)."""

    __slots__ = ("done", "event", "value")

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.event = threading.Event()

    def set(self, value: Any) -> None:
        self.value, self.done = value, True
        self.event.set()


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
        self._pending_lock = threading.Lock()
        self._pending: list[tuple[Push, _Answer]] = []
        # pushes and pulls served, by transport (the data plane's sockets, or Dask actor calls)
        self.by_transport = {"plane": 0, "dask": 0}
        # the dense offload's outer products this node computed (either transport)
        self.outer_products = 0

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
            self._worker.address, dedup_window=self.cfg["dedup_window"], checkpoint=bool(ckpt)
        )
        if ckpt:
            self._writeback = WriteBack(self.server_id, self._worker, self.cfg, self._handle)
        self._plane = plane_server(self._worker)
        self._plane.register(self.server_id, self)
        self._forwarder = Forwarder(self.server_id, self._worker, self.cfg, self._handle)
        self._timers = [
            spawn(self._every(self.cfg["forward_interval"], self._forward_tick)),
            spawn(self._every(self.cfg["heartbeat_interval"], self._heartbeat)),
        ]
        if ckpt:
            self._timers.append(
                spawn(self._every(self.cfg["writeback_interval"], self._write_tick))
            )
        return self.state

    def _do(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Reply) and isinstance(a.req, _Answer):  # a data-plane request
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
                spawn(self._writeback.write(a.snaps))
            else:  # pragma: no cover - every action of NodeState is handled above
                raise TypeError(f"unknown node action {a!r}")

    def _handle(self, event: Any) -> None:
        state = self._start()
        with self._lock:
            actions = handle(state, event)
        self._do(actions)

    async def _ask(self, make: Any) -> Any:
        """Feed the event ``make(req)`` and wait for its reply."""
        state = self._start()
        req = next(self._reqs)
        fut = asyncio.get_running_loop().create_future()
        self._futures[req] = fut
        with self._lock:
            actions = handle(state, make(req))
        self._do(actions)
        try:
            return await fut
        finally:
            self._futures.pop(req, None)

    async def _every(self, seconds: float, fn: Any) -> None:
        while not self._closed:
            await asyncio.sleep(float(seconds))
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # pragma: no cover - a timer must keep running
                logger.exception("node %s: %s failed", self._worker.address, fn.__name__)

    # -- timers ----------------------------------------------------------------------------------

    async def _forward_tick(self) -> None:
        self._handle(ForwardDue())

    async def _write_tick(self) -> None:
        if self._writeback is not None and self._writeback.due():
            self._handle(WriteDue())

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
        gens = {int(s): int(g) for s, g in reply["gens"].items()}
        self._handle(HeartbeatReply(bool(reply["member"]), gens))

    # -- commands from the controller ------------------------------------------------------------

    async def start(self, key: str) -> None:
        """Compile the kernels (in a thread: the loop keeps answering), then start the timers;
        ``key`` is this actor's key (it names the node in heartbeats)."""
        from ..kernels import warm_up

        await asyncio.to_thread(warm_up)
        self.key = key
        self._start()

    async def assign(
        self, shards: dict, gens: dict, primaries: dict | None = None, version: int = 0
    ) -> None:
        """Hold ``shards`` {sid: (start, stop)} at ``gens``; be primary of ``primaries``."""
        shards = {int(s): (int(a), int(b)) for s, (a, b) in shards.items()}
        gens = {int(s): int(g) for s, g in gens.items()}
        prim = {int(s): [tuple(p) for p in ps] for s, ps in (primaries or {}).items()}
        await self._ask(lambda r: Assign(r, shards, gens, prim, int(version)))

    async def load(self, values: dict, versions: dict, marks: dict | None = None) -> None:
        """Initial values of held shards at ``versions`` (a new or restored server), with the
        data positions (``marks`` {sid: [Mark]}) they hold."""
        state = self._start()
        with self._lock:
            state.load({int(s): v for s, v in values.items()}, versions, marks)

    async def fence(self, gens: dict) -> dict:
        return await self._ask(lambda r: Fence(r, {int(s): int(g) for s, g in gens.items()}))

    async def promote(self, shards: dict, stamp: int = 0) -> dict:
        shards = {int(s): (int(g), [tuple(p) for p in ps]) for s, (g, ps) in shards.items()}
        return await self._ask(lambda r: Promote(r, shards, int(stamp)))

    async def restore(self, sid: int, gen: int, start: int, stop: int, block: Any) -> int:
        """Become the primary of ``sid``, rebuilt from the checkpoint block ``block`` =
        (path, generation, version)."""
        self._start()
        if self._writeback is None:
            raise ShardUnavailable(f"shard {sid}: no checkpoint to restore it from")
        values, attrs, ids = await asyncio.to_thread(self._writeback.store.read, block[0])
        version = int(attrs["version"])
        from ..checkpoint import block_marks

        marks = block_marks(attrs)
        return await self._ask(
            lambda r: Restore(
                r, int(sid), int(gen), int(start), int(stop), version, values, ids, marks
            )
        )

    async def set_backups(self, shards: dict, stamp: int = 0) -> None:
        shards = {int(s): [tuple(p) for p in ps] for s, ps in shards.items()}
        await self._ask(lambda r: SetBackups(r, shards, int(stamp)))

    async def add_backups(self, shards: dict, stamp: int = 0) -> dict:
        shards = {int(s): [tuple(p) for p in ps] for s, ps in shards.items()}
        return await self._ask(lambda r: AddBackups(r, shards, int(stamp)))

    async def drop(self, sids: Iterable[int]) -> None:
        await self._ask(lambda r: Drop(r, tuple(int(s) for s in sids)))

    async def close(self) -> None:
        """Stop the timers and forwards (called before the actor is released)."""
        self._closed = True
        if self._plane is not None:
            self._plane.unregister(self.server_id, self)
        for t in self._timers:
            t.cancel()
        if self._forwarder is not None:
            self._forwarder.close()

    # -- update path -----------------------------------------------------------------------------

    async def push(
        self,
        deltas: dict,
        push_id: int | None = None,
        ack: str | None = None,
        stamps: dict | None = None,
        mark: Mark | None = None,
        scanned: bool = False,
    ) -> dict:
        """Add {sid: delta} to the primaries held here. Returns ``{"per_shard": {sid:
        version}, "moved": [sid, ...], "confirmed": {sid: version every copy holds}, "durable":
        {sid: version the checkpoint holds too}}``;
        ``moved`` lists the shards this node may not take (the caller refreshes its routing
        and retries them). Raises :class:`UpdateRejected` (nothing applied) for a bad delta.
        ``mark``: what the push covers of the pusher's data (:class:`Mark`), recorded with it.
        ``scanned``: the pusher checked the values for NaN/Inf."""
        self.by_transport["dask"] += 1
        return await self._push(deltas, push_id, ack, stamps, mark, scanned)

    async def _push(
        self,
        deltas: dict,
        push_id: int | None,
        ack: str | None,
        stamps: dict | None,
        mark: Mark | None,
        scanned: bool = False,
    ) -> dict:
        self._start()
        fut = asyncio.get_running_loop().create_future()
        req = next(self._reqs)
        self._futures[req] = fut
        st = None if stamps is None else {int(s): int(g) for s, g in stamps.items()}
        ds = {int(s): d for s, d in deltas.items()}
        self._queue.append(Push(req, ds, push_id, st, ack or self.cfg["ack"], mark, scanned))
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
            self._handle(Pushes(items))

    async def push_outer(
        self,
        parts: dict,
        offset: int,
        out: int,
        inp: int,
        activations: np.ndarray,
        scale: float = 1.0,
        push_id: int | None = None,
        ack: str | None = None,
        stamps: dict | None = None,
        mark: Mark | None = None,
    ) -> dict:
        """Add each shard's part of ``scale * errors.T @ activations``; ``parts`` maps sid ->
        the error columns of the rows touching it. The product is computed here, in a thread,
        and applied like a push."""
        state = self._start()
        self.by_transport["dask"] += 1
        self.outer_products += 1
        st = None if stamps is None else {int(s): int(g) for s, g in stamps.items()}
        todo = {int(s): e for s, e in parts.items() if state.accepts(int(s), st)}

        def compute() -> dict[int, np.ndarray]:
            return {
                s: state.shards[s].outer_as_delta(offset, out, inp, e, activations, scale)
                for s, e in todo.items()
                if s in state.shards
            }

        deltas = await asyncio.to_thread(compute) if todo else {}
        res = await self._push(deltas, push_id, ack, stamps, mark) if deltas else None
        moved = [int(s) for s in parts if int(s) not in deltas]
        if res is None:
            return {"per_shard": {}, "moved": moved, "confirmed": {}, "durable": {}}
        res["moved"] = sorted(set(res["moved"]) | set(moved))
        return res

    async def pull(self, sids: Iterable[int] | None = None, stamps: dict | None = None) -> dict:
        """``{"per_shard": {sid: values}, "moved": [...]}`` for the primaries among ``sids``."""
        state = self._start()
        self.by_transport["dask"] += 1
        sids = tuple(state.primaries) if sids is None else tuple(int(s) for s in sids)
        st = None if stamps is None else {int(s): int(g) for s, g in stamps.items()}
        return await self._ask(lambda r: Pull(r, sids, st))

    # -- the data plane (called from its connection threads, not the event loop) ---------------

    def plane_push(
        self,
        deltas: dict,
        push_id: int,
        ack: str,
        stamps: dict,
        mark: Mark | None,
        urgent: bool = False,
    ) -> dict:
        """A data-plane push (values scanned by the pusher), applied in the calling thread.

        Flat combining: the push joins the pending ones; the thread that holds the state's lock
        applies every pending push as one batch (:class:`Pushes`, as the event loop batches
        actor calls) and hands each its answer, so a lone push costs no hop to the event loop
        and many at once are applied together. Other actions (forwards) go to the loop.
        ``urgent``: the pusher holds as many pushes as it may, forward to the backups now (its
        next answers then confirm them) instead of at the next ``forward-interval``. With
        ``ack="all"`` the answer comes once the backups hold the push (up to ``call_timeout``)."""
        state = self._start()
        self.by_transport["plane"] += 1
        slot = _Answer()
        with self._pending_lock:
            self._pending.append((Push(slot, deltas, push_id, stamps, ack, mark, True), slot))
        with self._lock:
            rest = []
            if not slot.done:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                actions = handle(state, Pushes(tuple(p for p, _ in batch)))
                for a in actions:
                    if isinstance(a, Reply) and isinstance(a.req, _Answer):
                        a.req.set(a.value)
                    else:
                        rest.append(a)
            if urgent:
                rest += handle(state, ForwardDue())
            if rest:
                self._worker.loop.asyncio_loop.call_soon_threadsafe(self._do, rest)
        if not slot.event.wait(float(self.cfg["call_timeout"])):
            raise ShardUnavailable(
                f"node {self._worker.address}: the backups did not take push {push_id:x} in "
                f"{self.cfg['call_timeout']}s (ack='all')",
                "check the PS workers",
            )
        if isinstance(slot.value, BaseException):
            raise slot.value
        return slot.value

    def plane_outer(self, parts: dict, offset: int, out: int, inp: int, scale: float) -> dict:
        """The dense offload's update where it arrives: each shard's delta of ``scale *
        errors.T @ activations`` (``parts`` {sid: (error columns, activations)}), computed in
        the calling connection thread for the primaries here; the pusher sends it on with
        :meth:`plane_push`. Shards not primary here are left out (the push reports them moved)."""
        state = self._start()
        self.outer_products += 1
        with self._lock:
            shards = {s: state.shards[s] for s in parts if s in state.primaries}
        return {
            s: st.outer_as_delta(offset, out, inp, parts[s][0], parts[s][1], scale)
            for s, st in shards.items()
        }

    def plane_replicate(self, sender: str, snaps: tuple[Snapshot, ...]) -> dict:
        """A data-plane forward from the primary ``sender``, installed in the calling thread
        (the same :class:`Replicate` event as :meth:`replicate`); other actions go to the loop."""
        slot = self._here(lambda req: [Replicate(req, sender, tuple(snaps))])
        held = {int(s): [int(p[0]), int(p[1])] for s, p in slot.value["held"].items()}
        refused = {int(s): int(g) for s, g in slot.value["refused"].items()}
        return {"held": held, "refused": refused}

    def plane_read(self, sids: list[int], stamps: dict | None, dest: Any) -> tuple:
        """A data-plane pull (:meth:`NodeState.read_into`), between two batches of pushes."""
        state = self._start()
        self.by_transport["plane"] += 1
        with self._lock:
            return state.read_into(sids, stamps, dest)

    def plane_confirmed(self, sids: list[int], urgent: bool = False) -> dict:
        """What every copy (and the checkpoint) holds of the primaries among ``sids``, asked on
        the data plane; ``urgent``: forward to the backups now (a pusher waits for room)."""
        return self._here(
            lambda req: (
                [Confirmed(req, tuple(int(s) for s in sids))] + ([ForwardDue()] if urgent else [])
            )
        ).value

    def _here(self, events: Any) -> _Answer:
        """Feed ``events(slot)`` in the calling thread (a data-plane connection's) under the
        state's lock; the reply to ``slot`` comes back here at once, other actions go to the
        event loop."""
        state = self._start()
        slot = _Answer()
        with self._lock:
            actions = [a for ev in events(slot) for a in handle(state, ev)]
        rest = []
        for a in actions:
            if isinstance(a, Reply) and a.req is slot:
                slot.set(a.value)
            else:
                rest.append(a)
        if rest:
            self._worker.loop.asyncio_loop.call_soon_threadsafe(self._do, rest)
        if not slot.done:  # pragma: no cover - these events are answered at once
            raise RuntimeError("a data-plane request was not answered")
        return slot

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
        return await self._ask(lambda r: Versions(r, tuple(int(s) for s in sids), True))

    async def versions(self, sids: Iterable[int] | None = None) -> dict[int, int]:
        """{sid: version} of the shards held here (all, or ``sids``)."""
        sids_t = None if sids is None else tuple(int(s) for s in sids)
        return await self._ask(lambda r: Versions(r, sids_t))

    async def marks(self, sids: Iterable[int], epoch: int) -> dict:
        """``{"per_shard": {sid: {replica: Mark}}, "moved": [...]}``: the data positions of
        ``epoch`` the primaries among ``sids`` hold."""
        return await self._ask(lambda r: Marks(r, tuple(int(s) for s in sids), int(epoch)))

    async def confirmed(self, sids: Iterable[int]) -> dict:
        """``{"per_shard": {sid: version every copy holds}, "moved": [...]}``."""
        return await self._ask(lambda r: Confirmed(r, tuple(int(s) for s in sids)))

    async def replicate(self, snaps: list[Snapshot], sender: str = "") -> dict:
        """A forward from a primary: ``{"held": {sid: (gen, version)}, "refused": {sid: gen}}``."""
        return await self._ask(lambda r: Replicate(r, sender, tuple(snaps)))

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
            return await asyncio.wait_for(self._ask(flush), limit)
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

    async def stats(self) -> dict:
        """Counters and lags of this node (see ParameterServer.stats)."""
        state = self._start()
        out = self._locked(state.stats)
        out["address"] = self._worker.address
        out["uptime"] = time.time() - self._started
        out["plane_forwards"] = self._forwarder.counts() if self._forwarder else None
        out["by_transport"] = dict(self.by_transport)
        out["outer_products"] = self.outer_products
        lag = out["writeback_lag_versions"]
        last = self._writeback.last_write if self._writeback is not None else time.time()
        out["writeback_lag_seconds"] = time.time() - last if lag > 0 else 0.0
        return out
