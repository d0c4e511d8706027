"""An epoch's partitioned replicas on the cluster, driven from the client: each replica as its
partitions' tasks (:func:`~adam_dask.train._partition_task.run_partition`), run again after a
partition was lost, and its result combined from its partitions'.

:class:`PartitionedReplicas` is what :func:`~adam_dask.train._submit.run_replicas` drives for
an epoch whose jobs carry a :class:`~adam_dask.train.task.Partitioning`. It submits every
replica's partitions, each pinned to a TRAIN worker of its own with ``resources={"TRAIN": 1}``
(one partition per worker at once). When a partition's worker dies, its neighbours see their
socket close and stop (pushing the groups they took whole, nothing else); the driver then sets
the attempt's abort event (every partition, and Dask's automatic re-run of the lost task,
return at once), waits until every task of the attempt has ended, and submits the replica again
under the next attempt number: its partition 0 plans from the marks the shards hold, so every
image is applied once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import config
from ..cluster import TRAIN, workers_with_role
from ._partition_task import PartitionJob, run_partition
from ._result import ReplicaResult
from .task import ReplicaJob, epoch_barrier

if TYPE_CHECKING:
    from ._handle import ReplicaServer

__all__ = ["PartitionedReplicas", "combine"]

logger = logging.getLogger(__name__)


def combine(job: ReplicaJob, parts: Sequence[dict], attempts: int, seconds: float) -> ReplicaResult:
    """Replica ``job``'s result from its partitions' results (``parts``, in partition order)
    of its last attempt, its ``attempts``-th, ending ``seconds`` after the epoch started."""
    first, last = parts[0], parts[-1]
    return ReplicaResult(
        replica=job.replica,
        epoch=job.epoch,
        images=int(first["images"]),
        images_pushed=min(int(p["images_pushed"]) for p in parts),
        loss=last["loss_sum"] / last["images"] if last["images"] else float("nan"),
        seconds=seconds,
        train_seconds=max(p["seconds"] for p in parts),
        pushes=sum(int(p["pushes"]) for p in parts),
        ps_seconds=max(p["ps_seconds"] for p in parts),
        stopped=bool(first.get("stopped")),
        workers=tuple(p["worker"] for p in parts),
        threads=int(first.get("threads", 1)),
        lr_end=float(first["lr_end"]),  # partition 0 fed the replica at it
        partitions=len(parts),
        cross_bytes=sum(int(p["bytes_sent"]) for p in parts),
        # partition 0 feeds the replica: its share, its data stream, its damped rate
        images_retrained=first.get("images_retrained"),
        images_before=first.get("images_before"),
        stall_fraction=first.get("stall_fraction"),
        wait_seconds=first.get("wait_seconds"),
        damping=first.get("damping"),
        unreplicated_at_end=first.get("unreplicated_at_end"),
        attempts=attempts,
    )


class PartitionedReplicas:
    """One epoch's ``jobs`` (one per replica, each with its ``partitioning``), every replica as
    its partitions' tasks pinned to distinct TRAIN workers; :meth:`collect` returns each
    replica once all its partitions finished, and runs a replica again (next attempt, on the
    TRAIN workers free then) whose partition was lost."""

    def __init__(
        self, client: Any, jobs: Sequence[ReplicaJob], *, server: ReplicaServer, data: Any
    ):
        part = jobs[0].partitioning
        self.client, self.jobs, self.server, self.data = client, list(jobs), server, data
        self.bounds = part.bounds
        self.timeout = float(config.get("train.partition-timeout"))
        self.max_attempts = int(config.get("train.partition-attempts"))
        self.start_timeout = float(config.get("cluster.start-timeout"))
        R = len(jobs)
        self.attempt = dict.fromkeys(range(R), 0)
        self.results: dict[int, dict[int, dict]] = {r: {} for r in range(R)}
        # replica -> its current attempt's unfinished futures, with their partition and worker
        self.open: dict[int, dict[Any, tuple[int, str]]] = {r: {} for r in range(R)}
        self.all: list[Any] = []
        # tasks of aborted attempts that did not end within the timeout (a frozen worker):
        # their workers get no partition while they run
        self.stuck: dict[Any, str] = {}
        self.aborted_at: dict[int, float] = {}
        self.finished: set[int] = set()
        self.t0 = time.perf_counter()
        # synchronous mode (a whole model's one stage): the epoch's barrier
        self._barrier_future, self.barrier = epoch_barrier(client, jobs)

    def _pjob(self, r: int, p: int) -> PartitionJob:
        return PartitionJob.of(self.jobs[r], p, self.attempt[r])

    def submit(self) -> None:
        """Submit every replica's partitions (the epoch starts now)."""
        self.t0 = time.perf_counter()
        for r in range(len(self.jobs)):
            self._submit(r)

    def _submit(self, r: int) -> None:
        from distributed import Event

        from ..errors import ClusterError

        # pinned, one partition per worker: a task queued behind another partition's held
        # TRAIN resource would wait for it forever
        P, client = len(self.bounds), self.client
        deadline = time.monotonic() + self.start_timeout
        while True:
            for f in [f for f in self.stuck if f.done()]:
                del self.stuck[f]
            busy = {w for per in self.open.values() for _, w in per.values()}
            busy |= set(self.stuck.values())
            free = [w for w in workers_with_role(client, TRAIN) if w not in busy]
            if len(free) >= P:
                break
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"replica {r} of epoch {self.jobs[r].epoch} needs {P} free TRAIN workers, "
                    f"{len(free)} are free",
                    "add TRAIN workers, or train with fewer partitions",
                )
            time.sleep(0.25)
        Event(self._pjob(r, 0).abort_name, client=client).clear()
        for p in range(P):
            pj = self._pjob(r, p)
            f = client.submit(
                run_partition,
                pj,
                server=self.server,
                data=self.data,
                barrier=self.barrier,
                workers=[free[p]],
                allow_other_workers=False,
                resources={TRAIN: 1},
                pure=False,
                key=f"{pj.name}-p{p}",
            )
            self.open[r][f] = (p, free[p])
            self.all.append(f)

    def pending(self) -> list[Any]:
        """The current attempts' unfinished partition tasks."""
        return [f for per in self.open.values() for f in per]

    def futures(self) -> list[Any]:
        """Every partition task submitted this epoch."""
        return list(self.all)

    def collect(self) -> list[ReplicaResult]:
        """The replicas whose partitions all finished since the last call; a replica whose
        partition was lost, froze or gave up runs again. Raises an :class:`AdamError` a
        partition raised, and :class:`ClusterError` once a replica's attempts are spent."""
        from ..errors import ClusterError

        live = set(workers_with_role(self.client, TRAIN))
        done: list[ReplicaResult] = []
        P, epoch = len(self.bounds), self.jobs[0].epoch
        for r in range(len(self.jobs)):
            self._reap(r, live)
            if self.open[r] or r in self.finished:
                continue
            parts = [self.results[r][q] for q in range(P)]
            reasons = [q["aborted"] for q in parts if q.get("aborted")]
            if reasons:
                if self.attempt[r] + 1 >= self.max_attempts:
                    raise ClusterError(
                        f"replica {r} of epoch {epoch}: {self.max_attempts} attempts of its "
                        f"{P} partitions failed (the last: {reasons[0]})",
                        "check the TRAIN workers, or raise adam.train.partition-attempts",
                    )
                logger.warning(
                    "epoch %d: replica %d's partitions stopped (%s); running it again",
                    epoch,
                    r,
                    "; ".join(sorted(set(reasons))),
                )
                self.attempt[r] += 1
                self.results[r] = {}
                self.aborted_at.pop(r, None)
                self._submit(r)
                continue
            self.finished.add(r)
            seconds = time.perf_counter() - self.t0
            done.append(combine(self.jobs[r], parts, self.attempt[r] + 1, seconds))
        return done

    def _reap(self, r: int, live: set[str]) -> None:
        """Take in replica ``r``'s partition tasks that ended, whose worker (not in ``live``)
        was lost, or that do not end after their attempt was aborted."""
        from ..errors import AdamError

        for f, (p, w) in list(self.open[r].items()):
            if f.done():
                del self.open[r][f]
                try:
                    res = f.result()
                except AdamError:
                    raise
                except Exception as exc:  # lost with its worker, and the like
                    res = {"partition": p, "aborted": f"{type(exc).__name__}: {exc}"}
                self._ended(r, p, res)
            elif w not in live:  # its worker died: the pinned task never runs again
                del self.open[r][f]
                f.cancel()
                self._ended(r, p, {"partition": p, "aborted": f"its worker {w} was lost"})
            elif r in self.aborted_at and time.monotonic() - self.aborted_at[r] > self.timeout:
                # aborted, and it does not end: frozen. Awake again it sees the abort and
                # pushes nothing more; its worker waits until it ends.
                del self.open[r][f]
                self.stuck[f] = w
                why = f"its worker {w} does not answer"
                self._ended(r, p, {"partition": p, "aborted": why})

    def _ended(self, r: int, p: int, res: dict) -> None:
        from distributed import Event

        self.results[r][p] = res
        if res.get("aborted") and r not in self.aborted_at:  # every partition of it gives up
            self.aborted_at[r] = time.monotonic()
            Event(self._pjob(r, p).abort_name, client=self.client).set()

    def abort(self) -> None:
        """The epoch stops on an error: every replica's current attempt gives up."""
        from distributed import Event

        for r in range(len(self.jobs)):
            Event(self._pjob(r, 0).abort_name, client=self.client).set()

    def close(self) -> None:
        """The epoch's barrier (synchronous mode) is released; nothing else of its own
        outlives the epoch."""
        if self._barrier_future is not None:
            self._barrier_future.release()
