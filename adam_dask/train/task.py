"""The Dask side of a model replica: one epoch of one replica as a long-running task.

:func:`run_replica` runs on a TRAIN worker. It secedes (so it holds no thread slot and is never
stolen), builds a :class:`~adam_dask.train.replica.HogwildReplica` (the Dask-free engine), pulls
the weights from the parameter server, and trains on its share of the epoch from the data
service's stream. Every ``push_every`` images its exchange (:mod:`._exchange`) pushes the update
and pulls fresh weights: on a communicator thread in async mode, at a :class:`SyncBarrier` in
sync mode (the PS then applies the average of the replicas' updates, and every replica starts
each step from the same weights).

Control and reporting stay cheap: the stop signal (the epoch quorum) is a
:class:`distributed.Event` polled once per push, and progress goes to the client as a
``log_event`` on the topic ``adam-progress`` at most every ``adam.train.report-interval``
seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._result import ReplicaResult
from ._settings import RunSettings
from .schedule import Schedule

if TYPE_CHECKING:
    from ._exchange import Exchange
    from ._handle import ReplicaServer
    from ._share import Share
    from .replica import HogwildReplica

__all__ = [
    "PROGRESS_TOPIC",
    "BarrierRef",
    "EventPoll",
    "Partitioning",
    "ReplicaJob",
    "Reporter",
    "SyncBarrier",
    "epoch_barrier",
    "run_replica",
]

logger = logging.getLogger(__name__)

PROGRESS_TOPIC = "adam-progress"


@dataclass(frozen=True, slots=True)
class Partitioning:
    """A replica spread over partitions, one TRAIN worker each (the
    :class:`~adam_dask.model.partition.PartitionPlan` as its tasks need it)."""

    bounds: tuple[tuple[int, int, int, int], ...]  # each partition's layers and rows
    window: int  # mini-batches in flight through the replica


@dataclass(frozen=True, slots=True)
class ReplicaJob:
    """Everything one replica needs for one epoch; small and picklable. With ``partitioning``
    the replica runs as its partitions' tasks (:mod:`._partitioned`), else as one
    :func:`run_replica` task."""

    run_id: str
    replica: int
    replicas: int
    epoch: int
    model: dict  # engines.shipped(net): Network.to_dict() or TorchNetwork.job_dict()
    settings: RunSettings
    schedule: Schedule
    share_images: int  # about this replica's share of the epoch (for the schedule's progress)
    delay: float  # seconds of sleep per batch: a deliberately slow replica (experiments)
    partitioning: Partitioning | None = None

    @property
    def stop_name(self) -> str:
        return f"adam-{self.run_id}-stop-{self.epoch}"


class SyncBarrier:
    """The barrier of synchronous mode, as a Dask actor with async methods (no thread needed).

    ``await wait(replica, timeout)`` returns once every replica still in the epoch has arrived
    at the current step (generation), which then advances: ``{"ok": True, "generation": g}``.
    A replica re-run after its worker died rejoins under the same number. ``leave(replica)``
    takes a replica out (it finished its share). When a step waits longer than ``timeout``,
    every waiter of that step gets ``{"ok": False, "missing": [replicas not arrived], ...}``
    and the step is failed: the replicas raise an error naming the missing ones.
    """

    def __init__(self, replicas: int):
        self.expected = set(range(int(replicas)))
        self.arrived: set[int] = set()
        self.generation = 0
        self.failed: dict[int, list[int]] = {}
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _release(self) -> None:
        self.generation += 1
        self.arrived = set()
        self._condition().notify_all()

    async def wait(self, replica: int, timeout: float) -> dict:
        cond = self._condition()
        async with cond:
            gen = self.generation
            if gen - 1 in self.failed:
                return self._failure(gen - 1, timeout)
            self.arrived.add(int(replica))
            if self.expected <= self.arrived:
                self._release()
                return {"ok": True, "generation": gen}
            try:
                await asyncio.wait_for(
                    cond.wait_for(lambda: self.generation != gen), float(timeout)
                )
            except TimeoutError:
                if self.generation == gen:
                    self.failed[gen] = sorted(self.expected - self.arrived)
                    logger.warning(
                        "sync barrier: step %d timed out after %ss; missing replicas %s",
                        gen,
                        timeout,
                        self.failed[gen],
                    )
                    self._release()
            if gen in self.failed:
                return self._failure(gen, timeout)
            return {"ok": True, "generation": gen}

    def _failure(self, gen: int, timeout: float) -> dict:
        return {"ok": False, "generation": gen, "missing": self.failed[gen], "timeout": timeout}

    async def leave(self, replica: int) -> int:
        cond = self._condition()
        async with cond:
            self.expected.discard(int(replica))
            self.arrived.discard(int(replica))
            if self.arrived and self.expected <= self.arrived:
                self._release()
            return len(self.expected)


class _Counted:
    """Wraps a batch iterator: counts the images drawn (live progress), and sleeps ``delay``
    seconds per batch when set (a deliberately slow replica, for straggler experiments)."""

    def __init__(self, it: Any, delay: float = 0.0):
        self.it: Iterator = iter(it)
        self.delay = delay
        self.images = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        item = next(self.it)
        self.images += len(item[1])
        if self.delay:
            time.sleep(self.delay)
        return item


class EventPoll:
    """A Dask :class:`~distributed.Event` asked at most every ``interval`` seconds (each ask is
    a call to the scheduler); once set, it stays set. ``is_set()`` is what
    :meth:`HogwildReplica.train`'s ``stop_event`` and a partition's stop and abort flags ask."""

    def __init__(self, event: Any, interval: float = 0.5):
        self.event, self.interval = event, interval
        self._next = 0.0
        self._set = False

    def is_set(self) -> bool:
        now = time.monotonic()
        if not self._set and now >= self._next:
            self._next = now + self.interval
            self._set = bool(self.event.is_set())
        return self._set


class Reporter:
    """Progress events to the client, at most every ``interval`` seconds (and a final one)."""

    def __init__(self, worker: Any, job: ReplicaJob, t0: float):
        self.worker, self.job, self.t0 = worker, job, t0
        self.last = 0.0

    def report(self, images: int, pushes: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.job.settings.report_interval:
            return
        self.last = now
        self.worker.log_event(
            PROGRESS_TOPIC,
            {
                "run": self.job.run_id,
                "epoch": self.job.epoch,
                "replica": self.job.replica,
                "worker": self.worker.address,
                "images": images,
                "pushes": pushes,
                "final": final,
                "seconds": now - self.t0,
            },
        )


@dataclass(frozen=True, slots=True)
class BarrierRef:
    """Where the epoch's :class:`SyncBarrier` actor lives. A replica calls it by address and
    key (:func:`~adam_dask.ps.runtime.rpc.call_actor`), not through a Dask ``Actor`` handle: a handle
    deserialized in a task binds a future in the worker's client, and that future was seen
    reported "cancelled" while the actor was alive, failing the replica."""

    address: str
    key: str

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        from distributed import get_worker
        from distributed.utils import sync

        from ..ps.runtime.rpc import call_actor

        worker = get_worker()
        return sync(
            worker.loop,
            call_actor,
            worker.rpc,
            self.address,
            self.key,
            method,
            *args,
            timeout=timeout,
        )


def epoch_barrier(client: Any, jobs: Sequence[ReplicaJob]) -> tuple[Any, BarrierRef | None]:
    """In synchronous mode, the epoch's :class:`~adam_dask.train.task.SyncBarrier` actor on a
    PS worker: its future (hold it until the epoch ends: released, the scheduler would forget
    the actor and cancel the replicas that take it, "lost dependencies") and where the
    replicas call it. ``(None, None)`` in asynchronous mode."""
    from ..cluster import PS, workers_with_role

    first = jobs[0]
    if first.settings.mode != "sync":
        return None, None
    host = workers_with_role(client, PS)[0]
    future = client.submit(
        SyncBarrier,
        len(jobs),
        actor=True,
        workers=[host],
        allow_other_workers=False,
        key=f"adam-{first.run_id}-barrier-{first.epoch}",
    )
    future.result()  # the actor is up
    return future, BarrierRef(host, future.key)


def run_replica(
    job: ReplicaJob, server: ReplicaServer, data: Any, barrier: BarrierRef | None = None
) -> ReplicaResult:
    """Train replica ``job.replica`` (whole, on this worker) for epoch ``job.epoch``; returns
    what it did.

    Runs inside a Dask task on a TRAIN worker. ``server`` is a
    :class:`~adam_dask.ps.client.server.ParameterServer`, ``data`` a
    :class:`~adam_dask.data.serving.DataService`, ``barrier`` a :class:`SyncBarrier` actor
    (sync mode only). The replica starts from the server's weights and from the data position
    the server holds for it (:func:`~adam_dask.train._position.replica_plan`): it re-trains the
    stretches some shard misses, then the rest of its share.
    """
    from distributed import Event, get_worker, secede

    from .streams import resolve_push_every

    secede()
    worker = get_worker()
    t0 = time.perf_counter()
    every = resolve_push_every(job.settings.push_every, job.replicas)  # the trainer's plan set it
    rep = _engine(job, worker.state.nthreads, every)
    share = _start(job, rep, server)
    sync = job.settings.mode == "sync"
    exchange = _exchange(job, rep, server, share, barrier, every)
    stop = Event(job.stop_name)
    reporter = Reporter(worker, job, t0)
    stopped = stop.is_set()  # the epoch's quorum was reached before this replica started
    retrained = 0
    rest: _Rest | None = None
    done = False
    try:
        if not stopped:
            retrained, stopped = _retrain(rep, data, exchange, share, stop, job.delay)
        rest = _Rest(share, exchange, reporter, stop)
        if not stopped:
            rest.open(data)
        stats = rep.train(rest.batches, on_images=rest.on_images, every=every)
        exchange.finish()
        # the result counts this replica's pushes as applied: every copy holds them first
        # (ack="replay" keeps them until then; a primary lost now has them replayed here, not
        # after the epoch's images_applied and manifest). The checkpoint catches up by itself.
        server.settle(checkpoint=False)
        done = True
    finally:
        if not done:
            exchange.close()
        if sync and barrier is not None:
            barrier.call("leave", job.replica)
        stream_stats = rest.close() if rest is not None else {}
    assert rest is not None
    reporter.report(rest.images, exchange.pushes, final=True)
    return ReplicaResult(
        replica=job.replica,
        epoch=job.epoch,
        images=stats.images + retrained,
        images_pushed=exchange.images_pushed,
        loss=stats.loss,
        seconds=time.perf_counter() - t0,
        train_seconds=stats.seconds,
        pushes=exchange.pushes,
        ps_seconds=exchange.ps_seconds,
        stopped=bool(stopped or rest.stopped or stats.stopped),
        workers=(worker.address,),
        threads=rep.threads,
        lr_end=rep.lr,
        images_retrained=retrained,
        images_before=share.images_before,
        stall_fraction=float(stream_stats.get("stall_fraction", 0.0)),
        wait_seconds=float(stream_stats.get("wait_seconds", 0.0)),
        damping=rep.lr_damping,  # the one lr_end carries (a later push may have changed it)
        unreplicated_at_end=server.held()["unreplicated"],
    )


def _engine(job: ReplicaJob, nthreads: int, every: int) -> HogwildReplica:
    """The replica's Hogwild engine for ``job``, at the start of its epoch: one thread in sync
    mode, else ``job.settings.threads`` or the TRAIN worker's ``nthreads`` (the replica's
    threads share that worker's cores, not the client's); with ``offload_dense``, the dense
    layers worth offloading at a push every ``every`` images."""
    from ..model.engines import network_from_dict
    from .replica import HogwildReplica, profitable_offload

    s = job.settings
    net = network_from_dict(job.model)
    rep = HogwildReplica(
        net,
        threads=1 if s.mode == "sync" else (s.threads or nthreads),
        momentum=s.momentum,
        batch_size=s.batch_size,
        offload=profitable_offload(net, every) if s.offload_dense else [],
        schedule=job.schedule,
    )
    rep.set_progress(job.epoch)
    return rep


def _start(job: ReplicaJob, rep: HogwildReplica, server: ReplicaServer) -> Share:
    """Where the run of ``rep`` starts: the server's weights, then its share as the server's
    marks leave it (the stretches to re-train, the rest's position and push numbers)."""
    from ._share import Share

    rep.set_weights(server.pull())
    share = Share(job, server, synchronous=job.settings.mode == "sync")
    rep.set_progress(share.progress(share.images_before))
    return share


def _exchange(
    job: ReplicaJob,
    rep: HogwildReplica,
    server: ReplicaServer,
    share: Share,
    barrier: BarrierRef | None,
    every: int,
) -> Exchange:
    """The replica's exchange with ``server``: at ``barrier`` in sync mode (each replica
    pushes ``1/R`` of its update), on an exchange thread in async mode (a push due every
    ``every`` images; with other replicas, the rate damped while the pushes cover more)."""
    from ._exchange import AsyncExchange, SyncExchange

    label = f"replica {job.replica} in epoch {job.epoch}"
    marker = share.marker
    if job.settings.mode != "sync":
        return AsyncExchange(
            rep, server, label=label, marker=marker, push_every=every, damp=job.replicas > 1
        )

    def wait() -> dict:
        assert barrier is not None
        return barrier.call("wait", job.replica, job.settings.sync_timeout)

    scale = 1.0 / job.replicas
    return SyncExchange(rep, server, wait=wait, scale=scale, label=label, marker=marker)


def _retrain(
    rep: HogwildReplica, data: Any, exchange: Exchange, share: Share, stop: Any, delay: float
) -> tuple[int, bool]:
    """Re-train each of ``share``'s stretches (images some shards miss) alone and push it under
    its number; returns the images re-trained and whether ``stop`` ended it. A stretch stopped
    midway is not pushed (its number covers all of it)."""
    retrained = 0
    for stretch in share.stretches:
        stream = share.stretch_stream(data, stretch)
        try:
            st = rep.train(_Counted(stream, delay), stop_event=EventPoll(stop))
        finally:
            stream.close()
        if st.stopped:
            rep.take()
            return retrained, True
        exchange.push_stretch(stretch)
        retrained += st.images
    return retrained, False


class _Rest:
    """The rest of a replica's share, after its stretches: the batches from the data service
    (counted; none once the epoch stopped) and what the training threads do every
    ``push_every`` images (:meth:`on_images`): the schedule's progress, the exchange's step, a
    progress report, the epoch's stop."""

    def __init__(self, share: Share, exchange: Exchange, reporter: Reporter, stop: Any):
        self.share, self.exchange, self.reporter, self.stop = share, exchange, reporter, stop
        self.batches = _Counted(())
        self.stream: Any = None
        self.stopped = False

    def open(self, data: Any) -> None:
        """The rest's batches, from where the share's marks say."""
        self.stream = self.share.rest_stream(data)
        self.batches = _Counted(self.stream, self.share.job.delay)

    @property
    def images(self) -> int:
        """Images of the share done so far."""
        return self.share.images_before + self.batches.images

    def on_images(self, rep: HogwildReplica) -> None:
        rep.set_progress(self.share.progress(self.images))
        self.exchange.step()
        self.reporter.report(self.images, self.exchange.pushes)
        if self.stop.is_set():
            self.stopped = True
            rep.stop()

    def close(self) -> dict:
        """Close the stream; its statistics ({} without one)."""
        if self.stream is None:
            return {}
        stats = self.stream.stats()
        self.stream.close()
        return dict(stats)
