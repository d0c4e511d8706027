"""What one replica's tasks share for an epoch: its job (:class:`ReplicaJob`, over its
:class:`Partitioning`), the synchronous mode's barrier (:class:`SyncBarrier`, a Dask actor, and
:func:`epoch_barrier`), the epoch's stop as a cheap poll (:class:`EventPoll`) and progress to
the client (:class:`Reporter`). The tasks themselves are
:func:`~adam_dask.train._partition_task.run_partition`'s, driven by :mod:`._submit`.

Control and reporting stay cheap: the stop signal (the epoch quorum) is a
:class:`distributed.Event` asked at most every half second, and progress goes to the client as
a ``log_event`` on the topic ``adam-progress`` at most every ``adam.train.report-interval``
seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._settings import RunSettings
from .schedule import Schedule

__all__ = [
    "PROGRESS_TOPIC",
    "BarrierRef",
    "EventPoll",
    "Partitioning",
    "ReplicaJob",
    "Reporter",
    "SyncBarrier",
    "epoch_barrier",
]

logger = logging.getLogger(__name__)

PROGRESS_TOPIC = "adam-progress"


@dataclass(frozen=True, slots=True)
class Partitioning:
    """A replica over its partitions, one TRAIN worker each (the
    :class:`~adam_dask.model.partition.PartitionPlan` as its tasks need it; one partition:
    the whole model, a single stage)."""

    bounds: tuple[tuple[int, int, int, int], ...]  # each partition's layers and rows
    window: int  # mini-batches in flight through the replica


@dataclass(frozen=True, slots=True)
class ReplicaJob:
    """Everything one replica needs for one epoch; small and picklable. It trains over its
    ``partitioning``: one task for a whole model (a single stage), one per partition
    otherwise (:mod:`._submit`)."""

    run_id: str
    replica: int
    replicas: int
    epoch: int
    model: dict  # engines.shipped(net): Network.to_dict() or TorchNetwork.job_dict()
    settings: RunSettings
    schedule: Schedule
    share_images: int  # about this replica's share of the epoch (for the schedule's progress)
    delay: float  # seconds of sleep per batch: a deliberately slow replica (experiments)
    partitioning: Partitioning

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


class EventPoll:
    """A Dask :class:`~distributed.Event` asked at most every ``interval`` seconds (each ask is
    a call to the scheduler); once set, it stays set: a partition's stop and abort flags."""

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
