"""One epoch on the cluster, for the Trainer (trainer.py): how many replicas it runs (those its
data positions record, else a fixed count or one per TRAIN worker present), their jobs (whole
replicas, or each over ``partitions`` TRAIN workers), their run until the quorum, then the
copies flushed and the weights evaluated: the epoch's record. Functions of explicit arguments:
the arithmetic is ``_epoch.py``'s, the Dask tasks are ``_submit.py``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import config
from ..cluster import TRAIN, workers_with_role
from ..errors import ClusterError
from ..model.engines import shipped
from ._epoch import epoch_record, replica_count, share_sizes
from ._position import applied_images, recorded_replicas
from ._settings import RunSettings
from ._submit import run_replicas
from .schedule import Schedule
from .task import Partitioning, ReplicaJob

if TYPE_CHECKING:
    from ..model.partition import PartitionPlan
    from ._handle import TrainerServer

__all__ = ["epoch_replicas", "ps_stats", "replica_jobs", "replicas_now", "run_epoch"]

logger = logging.getLogger(__name__)


def train_workers(client: Any) -> list[str]:
    """The TRAIN workers, waiting up to ``adam.cluster.start-timeout`` while there are none:
    a TRAIN worker killed at an epoch's start is being replaced by its nanny (seconds)."""
    deadline = time.monotonic() + float(config.get("cluster.start-timeout"))
    while not (found := workers_with_role(client, TRAIN)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return found


def train_threads(client: Any) -> int:
    """Hogwild threads a replica runs where its threads are ``auto``: the most any TRAIN
    worker has (its ``--nthreads``), so the rate a plan shares among them is never too high."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return max(
        (int(workers[a].get("nthreads", 1)) for a in train_workers(client) if a in workers),
        default=1,
    )


def replicas_now(client: Any, fixed: int | None, partitions: int) -> int:
    """``fixed``, or one replica per TRAIN worker (per ``partitions`` of them) present now."""
    workers = len(train_workers(client))
    if partitions == 1:  # whole replicas beyond the TRAIN workers wait for one in turn
        return replica_count(fixed, workers)
    R = replica_count(fixed, max(1, workers // partitions))
    if partitions * R > workers:  # every partition of every replica at once
        raise ClusterError(
            f"{R} replica(s) of {partitions} partition(s) need {partitions * R} TRAIN "
            f"workers, the cluster has {workers}",
            "add TRAIN workers, or train with fewer replicas or partitions",
        )
    return R


def epoch_replicas(
    client: Any, server: TrainerServer, epoch: int, fixed: int | None, partitions: int
) -> int:
    """The replicas of ``epoch``: those its data positions name (an epoch resumed midway keeps
    its shares), else :func:`replicas_now`."""
    recorded = recorded_replicas(server.marks(epoch))
    if recorded is not None:
        logger.info("epoch %d resumes with its %d replicas", epoch, recorded)
        return recorded
    return replicas_now(client, fixed, partitions)


def replica_jobs(
    run_id: str,
    epoch: int,
    replicas: int,
    *,
    net: Any,
    settings: RunSettings,
    schedule: Schedule,
    images: int,
    slow: Mapping[int, float],
    partition_plan: PartitionPlan,
) -> list[ReplicaJob]:
    """The jobs of an epoch's ``replicas``: each a share of the ``images`` (``slow``: seconds
    per batch of the deliberately slowed replicas), each over the partitions of
    ``partition_plan`` (one: the whole model)."""
    model, shares = shipped(net), share_sizes(images, replicas)
    parts = Partitioning(tuple(partition_plan.bounds()), partition_plan.window)
    return [
        ReplicaJob(
            run_id=run_id,
            replica=i,
            replicas=replicas,
            epoch=epoch,
            model=model,
            settings=settings,
            schedule=schedule,
            share_images=shares[i],
            delay=float(slow.get(i, 0.0)),
            partitioning=parts,
        )
        for i in range(replicas)
    ]


def run_epoch(
    client: Any,
    jobs: Sequence[ReplicaJob],
    *,
    server: TrainerServer,
    data: Any,
    quorum: float,
    evaluate: Callable[[], float],
) -> dict:
    """Run an epoch's ``jobs`` until ``quorum`` of them finished (each whole or over its
    partitions, as the job says), flush the copies (the checkpoint is the Trainer's to commit,
    in the background: storage never holds training up), ``evaluate`` the weights; the
    epoch's history record."""
    job = jobs[0]
    ps_before = ps_stats(server)
    try:
        run = run_replicas(client, jobs, server=server, data=data, quorum=quorum)
    except BaseException:
        keep_what_was_trained(server)
        raise
    t = time.perf_counter()
    server.flush(copies_only=True)
    flush_seconds = time.perf_counter() - t
    images_applied = applied_images(server.marks(job.epoch))
    accuracy = evaluate()
    return epoch_record(
        job.epoch,
        run.results,
        replicas=len(jobs),
        seconds=run.seconds,
        quorum_seconds=run.quorum_seconds,
        flush_seconds=flush_seconds,
        accuracy=accuracy,
        ps_before=ps_before,
        ps_after=ps_stats(server),
        lr=job.schedule.at(job.epoch),
        lr_end=job.schedule.at(job.epoch + 1),
        mode=job.settings.mode,
        images_applied=images_applied,
    )


def keep_what_was_trained(server: TrainerServer) -> None:
    """An epoch stopped (the user's interrupt, a job's SIGTERM, an error), its replicas stopped:
    have the checkpoint take every push applied so far, so a run resumed from it (a Job's pod
    started again) re-trains none of the epoch's images. Bounded by ``adam.train.stop-timeout``
    (a pod's grace period is short); a checkpoint that can not take them is logged, not raised:
    the stop under way is what the caller sees."""
    if server is None or server.checkpoint is None:
        return
    try:
        server.flush(timeout=float(config.get("train.stop-timeout")))
    except Exception as exc:
        logger.warning("the stopped epoch's pushes are not all in the checkpoint: %s", exc)


def ps_stats(server: TrainerServer) -> dict:
    """The parameter server's statistics, {} when it does not answer (they never fail a run)."""
    try:
        return server.stats()
    except Exception:
        logger.debug("PS statistics unavailable", exc_info=True)
        return {}
