"""Running one epoch's replicas on the cluster: submit, wait for the quorum, stop the rest.

The Dask side of the Trainer's epoch (the arithmetic is in ``_epoch.py``). Every replica goes
the same way: :func:`run_replicas` submits the epoch's jobs, collects a
:class:`~adam_dask.train._result.ReplicaResult` per replica as it finishes, stops the rest at
the quorum, and on an error or interrupt stops them all and waits for their tasks. Every
replica trains through the partition pipeline
(:func:`~adam_dask.train._partition_task.run_partition`); a whole model is its one stage, a
task the scheduler places and re-runs (:class:`WholeReplicas`), a model over several workers
its partitions' tasks, pinned (:class:`~adam_dask.train._partitioned.PartitionedReplicas`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .. import config
from ..cluster import TRAIN
from ._epoch import quorum_size
from ._partition_task import PartitionJob, run_partition
from ._partitioned import combine
from ._result import ReplicaResult
from .task import ReplicaJob, epoch_barrier

if TYPE_CHECKING:
    from ._handle import ReplicaServer

__all__ = ["EpochRun", "ReplicaTasks", "WholeReplicas", "run_replicas"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EpochRun:
    """What the replicas of one epoch returned."""

    results: list[ReplicaResult]
    seconds: float
    quorum_seconds: float | None


class ReplicaTasks(Protocol):
    """One epoch's replicas as tasks on the cluster, driven by :func:`run_replicas`."""

    def submit(self) -> None:
        """Submit the replicas' tasks (the epoch's time runs from here)."""

    def pending(self) -> list[Any]:
        """The futures whose end may finish a replica (waited on)."""

    def collect(self) -> list[ReplicaResult]:
        """The replicas finished since the last call; raises the error that fails the epoch."""

    def futures(self) -> list[Any]:
        """Every task submitted (waited on when the epoch stops, then released)."""

    def abort(self) -> None:
        """The epoch stops on an error: what stops the tasks besides the epoch's stop event."""

    def close(self) -> None:
        """The epoch ended: let go of what served its tasks."""


def run_replicas(
    client: Any, jobs: Sequence[ReplicaJob], *, server: ReplicaServer, data: Any, quorum: float
) -> EpochRun:
    """Run ``jobs`` (one epoch, one per replica, whole or partitioned as the jobs say) until
    ``quorum`` of them finished; the others are stopped through the epoch's stop event. A
    replica's error stops the epoch and is raised."""
    from distributed import Event, wait

    first = jobs[0]
    R, epoch = len(jobs), first.epoch
    stop = Event(first.stop_name, client=client)
    stop.clear()
    tasks = _tasks(client, jobs, server=server, data=data)
    t0 = time.perf_counter()
    needed = quorum_size(R, quorum)
    results: list[ReplicaResult] = []
    quorum_seconds = None
    try:
        tasks.submit()
        while len(results) < R:
            pending = tasks.pending()
            if pending:
                try:
                    wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    pass
            for result in tasks.collect():
                results.append(result)
                logger.debug("replica result %s", result)
                if len(results) == needed and needed < R:
                    quorum_seconds = time.perf_counter() - t0
                    logger.info(
                        "epoch %d: %d of %d replicas done; stopping the rest", epoch, needed, R
                    )
                    stop.set()
    except BaseException:
        # an error, or the user's interrupt: the replicas are seceded tasks that cancelling a
        # future does not stop, so they are told to stop and awaited (as the scheduler sees
        # them) before the stop is lifted; a new fit must not run beside them
        stop.set()
        tasks.abort()
        running = _wait_ended(tasks.futures(), float(config.get("train.stop-timeout")))
        for f in tasks.futures():  # forgotten, so a new fit runs the same keys again
            if f.done():
                f.release()
            else:
                f.cancel()
        if running:
            logger.warning(
                "epoch %d: replica task(s) %s did not end within adam.train.stop-timeout after "
                "the stop; their stop stays set",
                epoch,
                ", ".join(running),
            )
        else:
            stop.clear()
        raise
    else:
        stop.clear()
        for f in tasks.futures():
            f.release()
    finally:
        tasks.close()
    return EpochRun(results, time.perf_counter() - t0, quorum_seconds)


def _tasks(
    client: Any, jobs: Sequence[ReplicaJob], *, server: ReplicaServer, data: Any
) -> ReplicaTasks:
    """The tasks of ``jobs``: their partitions' where a replica spans several workers."""
    if len(jobs[0].partitioning.bounds) > 1:
        from ._partitioned import PartitionedReplicas

        return PartitionedReplicas(client, jobs, server=server, data=data)
    return WholeReplicas(client, jobs, server=server, data=data)


class WholeReplicas:
    """One epoch's whole-model replicas: each the partition pipeline with the model as its one
    stage (:func:`~adam_dask.train._partition_task.run_partition`, partition 0 of 1), a task
    with ``resources={"TRAIN": 1}`` (one replica per worker at once, the others queued) and not
    pinned (Dask runs a replica again elsewhere when its worker dies), and in sync mode the
    epoch's :class:`~adam_dask.train.task.SyncBarrier` actor on a PS worker."""

    def __init__(
        self, client: Any, jobs: Sequence[ReplicaJob], *, server: ReplicaServer, data: Any
    ):
        self.client, self.jobs, self.server, self.data = client, list(jobs), server, data
        self.max_submissions = int(config.get("train.replica-submissions"))
        self.submissions = [1] * len(self.jobs)
        self.job_of: dict[str, ReplicaJob] = {}  # task key -> its replica's job
        self.all: list[Any] = []
        self.open: list[Any] = []
        self.t0 = time.perf_counter()
        self._barrier_future, self.barrier = epoch_barrier(client, jobs)

    def submit(self) -> None:
        """One graph for all replicas: the scheduler places them in one pass, each placement
        raising its worker's occupancy, so they spread over the TRAIN workers. (Submitted one
        by one, a replica that already seceded leaves its worker looking idle, and the next
        could queue there behind the held TRAIN resource; pinning instead breaks the rerun of
        a replica whose worker died.)"""
        self.t0 = time.perf_counter()
        keys = [self._key(job) for job in self.jobs]
        pjobs = [self._pjob(job) for job in self.jobs]
        self.all = self.client.map(run_partition, pjobs, pure=False, key=keys, **self._kw())
        self.open = list(self.all)

    def _pjob(self, job: ReplicaJob) -> PartitionJob:
        """Replica ``job``'s one stage, in its current submission."""
        return PartitionJob.of(job, 0, self.submissions[job.replica] - 1)

    def _kw(self) -> dict:
        return {
            "server": self.server,
            "data": self.data,
            "barrier": self.barrier,
            "resources": {TRAIN: 1},
        }

    def pending(self) -> list[Any]:
        return list(self.open)

    def _key(self, job: ReplicaJob) -> str:
        n = self.submissions[job.replica]
        key = f"adam-{job.run_id}-e{job.epoch}-r{job.replica}" + (f"-s{n}" if n > 1 else "")
        self.job_of[key] = job
        return key

    def collect(self) -> list[ReplicaResult]:
        """The replicas whose task ended since the last call; raises a replica's error. A
        replica whose run gave up (a push that failed) or whose task Dask gave up on
        (``KilledWorker``: the workers running it died, ``allowed-failures`` + 1 of them) is
        submitted again, ``adam.train.replica-submissions`` times in all: it resumes from the
        server's marks as Dask's own re-runs do."""
        from distributed import KilledWorker

        from ..errors import ClusterError

        done = [f for f in self.open if f.done()]
        self.open = [f for f in self.open if not f.done()]
        results = []
        for f in done:
            job = self.job_of[f.key]
            lost = f.status == "error" and isinstance(f.exception(), KilledWorker)
            out: dict = {} if lost else f.result()
            why = "every worker that ran it died" if lost else out.get("aborted")
            if why is None:
                n = self.submissions[job.replica]
                results.append(combine(job, [out], n, time.perf_counter() - self.t0))
                continue
            if self.submissions[job.replica] >= self.max_submissions:
                if lost:
                    f.result()  # Dask's own error
                raise ClusterError(
                    f"replica {job.replica} of epoch {job.epoch}: its {self.max_submissions} "
                    f"submissions failed (the last: {why})",
                    "check the TRAIN workers, or raise adam.train.replica-submissions",
                )
            self.submissions[job.replica] += 1
            logger.warning(
                "epoch %d: replica %d's task ended early (%s); submitting it again "
                "(%d of adam.train.replica-submissions %d)",
                job.epoch,
                job.replica,
                why,
                self.submissions[job.replica],
                self.max_submissions,
            )
            again = self.client.submit(
                run_partition, self._pjob(job), pure=False, key=self._key(job), **self._kw()
            )
            self.all.append(again)
            self.open.append(again)
        return results

    def futures(self) -> list[Any]:
        return list(self.all)

    def abort(self) -> None:
        """The epoch's stop event is what stops a whole replica."""

    def close(self) -> None:
        if self._barrier_future is not None:
            self._barrier_future.release()


def _wait_ended(futures: Sequence[Any], timeout: float) -> list[str]:
    """Wait until every task of ``futures`` ended (finished, erred or lost, by its future's
    state on the scheduler); returns the keys still running after ``timeout`` seconds."""
    from distributed import wait

    try:  # the ended ones left out: a cancelled one would make wait raise
        wait([f for f in futures if not f.done()], timeout=timeout)
    except TimeoutError:
        pass
    return [f.key for f in futures if not f.done()]
