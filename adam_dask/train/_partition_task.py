"""The Dask side of a partitioned replica: one long-running task per partition, each on a TRAIN
worker of its own, joined by TCP sockets, and the epoch driver that re-runs a replica whose
partition was lost.

:func:`run_partition` secedes, builds its :class:`~adam_dask.model.stage.Stage` from the
model's skeleton (it never allocates the whole model), pulls its span, meets its neighbours
(:func:`~adam_dask.train._links.meet`: through a :class:`distributed.Variable` named for the
replica, the attempt and the partition, and a token) and runs a
:class:`~adam_dask.train._pipeline.PartitionRunner`. Partition 0 feeds the replica from the
data service (:func:`~adam_dask.train._groups.replica_groups`), as an unpartitioned replica
would: first the pushes some shard misses (the stretches of
:func:`~adam_dask.train._position.replica_plan`), then the rest of its share.

:func:`run_partitioned` (the Trainer's epoch when ``partitions > 1``) submits every replica's
partitions, each with ``resources={"TRAIN": 1}`` (one partition per worker at once). When a
partition's worker dies, its neighbours see their socket close and stop (pushing the groups
they took whole, nothing else); the driver then sets the attempt's abort event (every
partition, and Dask's automatic re-run of the lost task, return at once), waits until every
task of the attempt has ended, and submits the replica again under the next attempt number:
its partition 0 plans from the marks the shards hold, so every image is applied once.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import config
from ..cluster import TRAIN
from ._epoch import quorum_size
from ._groups import replica_groups
from ._links import meet
from ._submit import EpochRun
from .task import EventPoll, ReplicaJob, Reporter

if TYPE_CHECKING:
    from ._handle import ReplicaServer

__all__ = ["PartitionJob", "cluster_plan", "run_partition", "run_partitioned"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PartitionJob:
    """One partition of one replica in one epoch, in one attempt."""

    replica: ReplicaJob
    partition: int
    parts: int
    bounds: tuple[tuple[int, int, int, int], ...]  # every partition's layers and rows
    attempt: int
    window: int
    timeout: float
    switch_interval: float  # sys.setswitchinterval while the partition runs

    @property
    def name(self) -> str:
        j = self.replica
        return f"adam-{j.run_id}-e{j.epoch}-r{j.replica}-a{self.attempt}"

    def address_name(self, partition: int) -> str:
        return f"{self.name}-p{partition}-addr"

    @property
    def abort_name(self) -> str:
        return f"{self.name}-abort"


def _aborted(job: PartitionJob, reason: str, worker: str, t0: float) -> dict:
    return {
        "partition": job.partition,
        "images": 0,
        "loss_sum": 0.0,
        "pushes": 0,
        "images_pushed": 0,
        "groups_pushed": [],
        "ps_seconds": 0.0,
        "seconds": time.perf_counter() - t0,
        "bytes_sent": 0,
        "aborted": reason,
        "worker": worker,
    }


def run_partition(job: PartitionJob, server: ReplicaServer, data: Any) -> dict:
    """Partition ``job.partition`` of replica ``job.replica.replica`` for one epoch, with the
    worker's switch interval at ``job.switch_interval``; returns its statistics (``aborted``:
    why it stopped early, None when it finished)."""
    from distributed import secede

    secede()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(job.switch_interval)
    try:
        return _run_partition(job, server, data)
    finally:
        sys.setswitchinterval(previous)


def _run_partition(job: PartitionJob, server: ReplicaServer, data: Any) -> dict:
    from distributed import Event, get_worker
    from distributed.comm.addressing import get_address_host

    from ..model.stage import Skeleton, Stage
    from ._pipeline import PartitionRunner

    worker = get_worker()
    t0 = time.perf_counter()
    rj, s = job.replica, job.replica.settings
    abort = EventPoll(Event(job.abort_name))
    if abort.is_set():  # a stale run of a lost task: its replica runs again under a new attempt
        return _aborted(job, "superseded", worker.address, t0)
    first, stop_layer, r0, r1 = job.bounds[job.partition]
    logger.debug("%s-p%d starts on %s", job.name, job.partition, worker.address)
    stage = Stage(Skeleton(rj.model), first, stop_layer, rows=(r0, r1))
    server.pull_range(stage.start, stage.stop, out=stage.flat)
    logger.debug("%s-p%d pulled its weights; meeting its neighbours", job.name, job.partition)
    links = meet(
        job.partition,
        job.parts,
        job.address_name,
        get_address_host(worker.address),
        job.timeout,
        abort,
    )
    if links is None:
        why = "aborted" if abort.is_set() else f"not within {job.timeout:.0f} s"
        return _aborted(job, f"the neighbours did not meet ({why})", worker.address, t0)
    up, down = links
    stop = EventPoll(Event(rj.stop_name))
    runner = PartitionRunner(
        stage,
        job.partition,
        job.parts,
        threads=s.threads or worker.state.nthreads,
        batch_size=s.batch_size,
        window=job.window,
        server=server,
        mark=(rj.epoch, rj.replica, rj.replicas),
        up=up,
        down=down,
        stop=stop,
        abort=abort,
        timeout=job.timeout,
    )
    reporter = Reporter(worker, rj, t0)
    groups = None
    if job.partition == 0:
        groups = replica_groups(rj, server, data, stop, lambda n: reporter.report(n, runner.pushes))
    out = runner.run(groups)
    if job.partition == 0:
        reporter.report(runner.images, runner.pushes, final=True)
    # what it pushed is held by every copy before the result counts (ack="replay")
    server.settle(checkpoint=False)
    out["worker"] = worker.address
    out["threads"] = runner.threads
    out["stopped"] = bool(stop.is_set())
    return out


def _combine(job: ReplicaJob, parts: Sequence[dict], retries: int, seconds: float) -> dict:
    """One replica's result (the fields an unpartitioned replica reports) from its partitions'
    last attempt."""
    first, last = parts[0], parts[-1]
    images = int(first["images"])
    return {
        "replica": job.replica,
        "epoch": job.epoch,
        "images": images,
        "images_pushed": min(int(p["images_pushed"]) for p in parts),
        "images_retrained": 0,
        "loss": last["loss_sum"] / last["images"] if last["images"] else float("nan"),
        "seconds": seconds,
        "train_seconds": max(p["seconds"] for p in parts),
        "pushes": sum(int(p["pushes"]) for p in parts),
        "ps_seconds": max(p["ps_seconds"] for p in parts),
        "stopped": bool(first.get("stopped")),
        "stall_fraction": 0.0,
        "wait_seconds": 0.0,
        "worker": ",".join(p["worker"] for p in parts),
        "threads": int(first.get("threads", 1)),
        "lr_end": job.schedule.at(job.epoch + 1),
        "unreplicated_at_end": 0,
        "partitions": len(parts),
        "partition_attempts": retries + 1,
        "cross_bytes": sum(int(p["bytes_sent"]) for p in parts),
    }


def run_partitioned(
    client: Any,
    jobs: Sequence[ReplicaJob],
    *,
    server: ReplicaServer,
    data: Any,
    quorum: float,
    bounds: Sequence[tuple[int, int, int, int]],
    window: int,
) -> EpochRun:
    """Run ``jobs`` (one epoch, one per replica), each replica as ``len(bounds)`` partition
    tasks pinned to distinct TRAIN workers, until ``quorum`` of the replicas finished; a
    replica whose partition was lost runs again (next attempt, on the TRAIN workers free then)
    from where the parameter server's marks say it stood."""
    from distributed import Event, wait

    from ..cluster import workers_with_role
    from ..errors import AdamError, ClusterError

    P = len(bounds)
    first = jobs[0]
    R, epoch = len(jobs), first.epoch
    timeout = float(config.get("train.partition-timeout"))
    max_attempts = int(config.get("train.partition-attempts"))
    switch = float(config.get("train.partition-switch-interval"))
    start_timeout = float(config.get("cluster.start-timeout"))
    stop = Event(first.stop_name, client=client)
    stop.clear()
    t0 = time.perf_counter()
    attempt = dict.fromkeys(range(R), 0)
    results: dict[int, dict[int, dict]] = {r: {} for r in range(R)}
    # replica -> its current attempt's unfinished futures, with their partition and worker
    open_: dict[int, dict[Any, tuple[int, str]]] = {r: {} for r in range(R)}
    futures: list[Any] = []
    # tasks of aborted attempts that did not end within the timeout (a frozen worker):
    # their workers get no partition while they run
    stuck: dict[Any, str] = {}
    aborted_at: dict[int, float] = {}

    def pjob(r: int, p: int) -> PartitionJob:
        return PartitionJob(jobs[r], p, P, tuple(bounds), attempt[r], window, timeout, switch)

    def submit(r: int) -> None:
        # pinned, one partition per worker: a task queued behind another partition's held
        # TRAIN resource would wait for it forever
        deadline = time.monotonic() + start_timeout
        while True:
            for f in [f for f in stuck if f.done()]:
                del stuck[f]
            busy = {w for per in open_.values() for _, w in per.values()} | set(stuck.values())
            free = [w for w in workers_with_role(client, TRAIN) if w not in busy]
            if len(free) >= P:
                break
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"replica {r} of epoch {epoch} needs {P} free TRAIN workers, "
                    f"{len(free)} are free",
                    "add TRAIN workers, or train with fewer partitions",
                )
            time.sleep(0.25)
        Event(pjob(r, 0).abort_name, client=client).clear()
        for p in range(P):
            pj = pjob(r, p)
            f = client.submit(
                run_partition,
                pj,
                server=server,
                data=data,
                workers=[free[p]],
                allow_other_workers=False,
                resources={TRAIN: 1},
                pure=False,
                key=f"{pj.name}-p{p}",
            )
            open_[r][f] = (p, free[p])
            futures.append(f)

    def ended(r: int, p: int, res: dict) -> None:
        results[r][p] = res
        if res.get("aborted") and r not in aborted_at:  # every partition of it gives up
            aborted_at[r] = time.monotonic()
            Event(pjob(r, p).abort_name, client=client).set()

    for r in range(R):
        submit(r)
    needed = quorum_size(R, quorum)
    done: list[dict] = []
    finished: set[int] = set()
    quorum_seconds = None
    try:
        while len(finished) < R:
            pending = [f for per in open_.values() for f in per]
            if pending:
                try:
                    wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    pass
            live = set(workers_with_role(client, TRAIN))
            for r in range(R):
                for f, (p, w) in list(open_[r].items()):
                    if f.done():
                        del open_[r][f]
                        try:
                            res = f.result()
                        except AdamError:
                            raise
                        except Exception as exc:  # lost with its worker, and the like
                            res = {"partition": p, "aborted": f"{type(exc).__name__}: {exc}"}
                        ended(r, p, res)
                    elif w not in live:  # its worker died: the pinned task never runs again
                        del open_[r][f]
                        f.cancel()
                        ended(r, p, {"partition": p, "aborted": f"its worker {w} was lost"})
                    elif r in aborted_at and time.monotonic() - aborted_at[r] > timeout:
                        # aborted, and it does not end: frozen. Awake again it sees the abort
                        # and pushes nothing more; its worker waits until it ends.
                        del open_[r][f]
                        stuck[f] = w
                        ended(r, p, {"partition": p, "aborted": f"its worker {w} does not answer"})
                if open_[r] or r in finished:
                    continue
                parts = [results[r][q] for q in range(P)]
                reasons = [q["aborted"] for q in parts if q.get("aborted")]
                if reasons:
                    if attempt[r] + 1 >= max_attempts:
                        raise ClusterError(
                            f"replica {r} of epoch {epoch}: {max_attempts} attempts of its "
                            f"{P} partitions failed (the last: {reasons[0]})",
                            "check the TRAIN workers, or raise adam.train.partition-attempts",
                        )
                    logger.warning(
                        "epoch %d: replica %d's partitions stopped (%s); running it again",
                        epoch,
                        r,
                        "; ".join(sorted(set(reasons))),
                    )
                    attempt[r] += 1
                    results[r] = {}
                    aborted_at.pop(r, None)
                    submit(r)
                    continue
                finished.add(r)
                done.append(_combine(jobs[r], parts, attempt[r], time.perf_counter() - t0))
                if len(done) == needed and needed < R:
                    quorum_seconds = time.perf_counter() - t0
                    logger.info(
                        "epoch %d: %d of %d replicas done; stopping the rest", epoch, needed, R
                    )
                    stop.set()
    except BaseException:
        stop.set()
        for r in range(R):
            Event(pjob(r, 0).abort_name, client=client).set()
        try:
            wait(futures, timeout=float(config.get("train.stop-timeout")))
        except TimeoutError:
            pass
        for f in futures:
            if f.done():
                f.release()
            else:
                f.cancel()
        raise
    stop.clear()
    for f in futures:
        f.release()
    return EpochRun(done, time.perf_counter() - t0, quorum_seconds)


def cluster_plan(client: Any, net: Any, settings: Any, partitions: int) -> Any:
    """The partition plan of ``net`` for this cluster's TRAIN workers (their threads and
    memory limit), checked: :class:`~adam_dask.errors.PartitionError` names a partition that
    does not fit (before anything starts). With more than one partition the plan is logged."""
    import dask

    from ..cluster import workers_with_role
    from ..errors import PartitionError
    from ..model.engines import TORCH
    from ..model.partition import plan_partitions

    if getattr(net, "engine", None) == TORCH:  # a user's nn.Module: no layer list to split
        if partitions > 1:
            raise PartitionError(
                f"partitions={partitions}: a PyTorch model trains on one worker per replica",
                "train a torch model with partitions=1 (partitioning splits the numba "
                "engine's layers)",
            )
        return None
    if partitions > 1:
        unsupported = [
            what
            for what, on in (
                ("mode='sync'", settings.mode == "sync"),
                (f"momentum={settings.momentum}", settings.momentum > 0),
                ("offload_dense", settings.offload_dense),
                (f"dropout={net.dropout}", net.dropout > 0),
            )
            if on
        ]
        if unsupported:
            raise PartitionError(
                f"a partitioned replica does not train with {', '.join(unsupported)}",
                "train with partitions=1, or turn those off",
            )
    train = set(workers_with_role(client, TRAIN))
    info = client.scheduler_info(n_workers=-1)["workers"] if train else {}
    ws = [w for a, w in info.items() if a in train]
    threads = settings.threads or min((int(w.get("nthreads", 1)) for w in ws), default=1)
    limits = [int(w.get("memory_limit") or 0) for w in ws]
    budget = None
    if limits and min(limits) > 0:
        pause = dask.config.get("distributed.worker.memory.pause")
        budget = int(min(limits) * (float(pause) if pause else 1.0))
    plan = plan_partitions(net, partitions, threads=threads, batch_size=settings.batch_size)
    if partitions > 1:
        logger.info("%s", plan.describe(budget))
    if budget is not None:
        plan.check(budget)
    return plan
