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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._settings import RunSettings
from .schedule import Schedule

if TYPE_CHECKING:
    from ._handle import ReplicaServer

__all__ = ["PROGRESS_TOPIC", "BarrierRef", "ReplicaJob", "SyncBarrier", "run_replica"]

logger = logging.getLogger(__name__)

PROGRESS_TOPIC = "adam-progress"


@dataclass(frozen=True, slots=True)
class ReplicaJob:
    """Everything one replica needs for one epoch; small and picklable."""

    run_id: str
    replica: int
    replicas: int
    epoch: int
    model: dict  # engines.shipped(net): Network.to_dict() or TorchNetwork.job_dict()
    settings: RunSettings
    schedule: Schedule
    share_images: int  # about this replica's share of the epoch (for the schedule's progress)
    delay: float  # seconds of sleep per batch: a deliberately slow replica (experiments)

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


class _Reporter:
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


def run_replica(
    job: ReplicaJob, server: ReplicaServer, data: Any, barrier: BarrierRef | None = None
) -> dict:
    """Train replica ``job.replica`` for epoch ``job.epoch``; returns its statistics.

    Runs inside a Dask task on a TRAIN worker. ``server`` is a
    :class:`~adam_dask.ps.client.server.ParameterServer`, ``data`` a
    :class:`~adam_dask.data.serving.DataService`, ``barrier`` a :class:`SyncBarrier` actor
    (sync mode only).
    """
    from distributed import Event, get_worker, secede

    from ..errors import ClusterError
    from ..model.engines import network_from_dict
    from ._exchange import AsyncExchange, Exchange, SyncExchange
    from ._position import Marker, resume_plan
    from .replica import HogwildReplica, profitable_offload
    from .streams import resolve_push_every

    secede()
    worker = get_worker()
    t0 = time.perf_counter()
    s = job.settings
    net = network_from_dict(job.model)
    sync = s.mode == "sync"
    every = resolve_push_every(s.push_every, job.replicas)  # the trainer's plan set it
    offload = profitable_offload(net, every) if s.offload_dense else []
    rep = HogwildReplica(
        net,
        # auto: as many Hogwild threads as the TRAIN worker has (its --nthreads), not the client's
        # cores: the replica's threads share that worker's cores
        threads=1 if sync else (s.threads or worker.state.nthreads),
        momentum=s.momentum,
        batch_size=s.batch_size,
        offload=offload,
        schedule=job.schedule,
    )
    rep.set_progress(job.epoch)
    rep.set_weights(server.pull())
    # where this run starts: the data position the parameter server holds for the replica
    plan = resume_plan({sid: m.get(job.replica, ()) for sid, m in server.marks(job.epoch).items()})
    if plan.replicas is not None and plan.replicas != job.replicas:
        raise ClusterError(
            f"replica {job.replica} of epoch {job.epoch} runs as one of {job.replicas}, but "
            f"its data position was recorded as one of {plan.replicas}",
            f"resume the epoch with {plan.replicas} replicas",
        )
    if plan.resumed:
        logger.info(
            "replica %d of epoch %d resumes at %d images, of which %d in %d stretch(es) to "
            "re-train for some shards; next push %d",
            job.replica,
            job.epoch,
            plan.images_done,
            sum(stretch.images for stretch in plan.stretches),
            len(plan.stretches),
            plan.next_seq,
        )
    marker = Marker(job.epoch, job.replica, job.replicas, plan, synchronous=sync)
    rep.set_progress(job.epoch + min(1.0, plan.images_done / max(1, job.share_images)))
    label = f"replica {job.replica} in epoch {job.epoch}"
    exchange: Exchange
    if sync:

        def wait() -> dict:
            assert barrier is not None
            return barrier.call("wait", job.replica, s.sync_timeout)

        exchange = SyncExchange(
            rep, server, wait=wait, scale=1.0 / job.replicas, label=label, marker=marker
        )
    else:
        exchange = AsyncExchange(rep, server, label=label, marker=marker)
    stop = Event(job.stop_name)
    reporter = _Reporter(worker, job, t0)
    base = plan.images_done
    retrained = 0
    stream: Any = None
    stopped = stop.is_set()  # the epoch's quorum was reached before this replica started
    batches = _Counted(())
    done = False
    try:
        for stretch in () if stopped else plan.stretches:  # images some shards miss, pushed alone
            seg_stream = data.stream(
                job.replica, job.replicas, job.epoch, return_key=True, only=stretch.items
            )
            try:
                st = rep.train(_Counted(seg_stream, job.delay), stop_event=EventPoll(stop))
            finally:
                seg_stream.close()
            if st.stopped:  # a part of a stretch must not be pushed: its number covers all of it
                rep.take()
                stopped = True
                break
            exchange.push_stretch(stretch)
            retrained += st.images
        base = sum(marker.position.values())
        if not stopped:
            stream = data.stream(
                job.replica, job.replicas, job.epoch, return_key=True, resume=marker.position
            )
            batches = _Counted(stream, job.delay)

        def on_images(r: HogwildReplica) -> None:
            nonlocal stopped
            progress = (base + batches.images) / max(1, job.share_images)
            r.set_progress(job.epoch + min(1.0, progress))
            exchange.step()
            reporter.report(base + batches.images, exchange.pushes)
            if stop.is_set():
                stopped = True
                r.stop()

        stats = rep.train(batches, on_images=on_images, every=every)
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
        stream_stats = stream.stats() if stream is not None else {}
        if stream is not None:
            stream.close()
    reporter.report(base + batches.images, exchange.pushes, final=True)
    return {
        "replica": job.replica,
        "epoch": job.epoch,
        "images": stats.images + retrained,
        "images_pushed": exchange.images_pushed,
        "images_retrained": retrained,
        "images_before": plan.images_done,
        "loss": stats.loss,
        "seconds": time.perf_counter() - t0,
        "train_seconds": stats.seconds,
        "pushes": exchange.pushes,
        "ps_seconds": exchange.ps_seconds,
        "stopped": bool(stopped or stats.stopped),
        "stall_fraction": float(stream_stats.get("stall_fraction", 0.0)),
        "wait_seconds": float(stream_stats.get("wait_seconds", 0.0)),
        "worker": worker.address,
        "threads": rep.threads,
        "lr_end": rep.lr,
        "unreplicated_at_end": server.held()["unreplicated"],
    }
