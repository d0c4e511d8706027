"""The task of one partition of a replica (each on a TRAIN worker of its own, joined to its
neighbours by TCP sockets), and the partition plan checked against the cluster
(:func:`cluster_plan`). The epoch drives a replica's partitions from :mod:`._partitioned`.

:func:`run_partition` secedes, builds its :class:`~adam_dask.model.stage.Stage` from the
model's skeleton (it never allocates the whole model), pulls its span, meets its neighbours
(:func:`~adam_dask.train._links.meet`: through a :class:`distributed.Variable` named for the
replica, the attempt and the partition, and a token) and runs a
:class:`~adam_dask.train._pipeline.PartitionRunner`. Partition 0 feeds the replica from the
data service (a :class:`~adam_dask.train._groups.ReplicaFeed`), as an unpartitioned replica
would: first the pushes some shard misses (the stretches of
:func:`~adam_dask.train._position.replica_plan`), then the rest of its share.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import config
from ..cluster import TRAIN
from ._groups import ReplicaFeed
from ._links import meet
from .task import BarrierRef, EventPoll, ReplicaJob, Reporter

if TYPE_CHECKING:
    from ._handle import ReplicaServer

__all__ = ["PartitionJob", "cluster_plan", "run_partition"]

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

    @classmethod
    def of(cls, replica: ReplicaJob, partition: int, attempt: int) -> PartitionJob:
        """Partition ``partition`` of ``replica`` (planned by its ``partitioning``) in attempt
        ``attempt``, with the neighbours' timeout and the switch interval of the config."""
        part = replica.partitioning
        return cls(
            replica,
            partition,
            len(part.bounds),
            part.bounds,
            attempt,
            part.window,
            float(config.get("train.partition-timeout")),
            float(config.get("train.partition-switch-interval")),
        )

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


def run_partition(
    job: PartitionJob, server: ReplicaServer, data: Any, barrier: BarrierRef | None = None
) -> dict:
    """Partition ``job.partition`` of replica ``job.replica.replica`` for one epoch, with the
    worker's switch interval at ``job.switch_interval``; returns its statistics (``aborted``:
    why it stopped early, None when it finished). ``barrier``: the epoch's
    :class:`~adam_dask.train.task.SyncBarrier` in synchronous mode (a whole model's one
    stage), left when the partition ends."""
    from distributed import secede

    secede()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(job.switch_interval)
    try:
        return _run_partition(job, server, data, barrier)
    finally:
        sys.setswitchinterval(previous)
        if barrier is not None:
            barrier.call("leave", job.replica.replica)


def _run_partition(
    job: PartitionJob, server: ReplicaServer, data: Any, barrier: BarrierRef | None
) -> dict:
    from distributed import Event, get_worker
    from distributed.comm.addressing import get_address_host

    from ..model.engines import network_from_dict
    from ..model.partition import profitable_offload
    from ..model.stage import Skeleton, Stage, WholeStage
    from ._pipeline import PartitionRunner
    from .streams import resolve_push_every

    worker = get_worker()
    t0 = time.perf_counter()
    rj, s = job.replica, job.replica.settings
    abort = EventPoll(Event(job.abort_name))
    if abort.is_set():  # a stale run of a lost task: its replica runs again under a new attempt
        return _aborted(job, "superseded", worker.address, t0)
    logger.debug("%s-p%d starts on %s", job.name, job.partition, worker.address)
    stage: Stage | WholeStage
    if job.parts == 1:  # the whole model, either engine, trained by its fused step
        net = network_from_dict(rj.model)
        every = resolve_push_every(s.push_every, rj.replicas)  # the trainer's plan set it
        stage = WholeStage(net, profitable_offload(net, every) if s.offload_dense else ())
    else:  # its own layers only: built from the skeleton, never the whole model
        first, stop_layer, r0, r1 = job.bounds[job.partition]
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
    step = None
    if barrier is not None:  # one thread, every replica's push of a step before its pull

        def step() -> dict:
            return barrier.call("wait", rj.replica, s.sync_timeout)

    runner = PartitionRunner(
        stage,
        job.partition,
        job.parts,
        threads=1 if step is not None else (s.threads or worker.state.nthreads),
        batch_size=s.batch_size,
        window=job.window,
        server=server,
        mark=(rj.epoch, rj.replica, rj.replicas),
        up=up,
        down=down,
        stop=stop,
        abort=abort,
        timeout=job.timeout,
        momentum=s.momentum,
        barrier=step,
    )
    reporter = Reporter(worker, rj, t0)
    feed = None
    if job.partition == 0:
        report = lambda n: reporter.report(n, runner.exchange.pushes)  # noqa: E731
        feed = ReplicaFeed(rj, server, data, report, synchronous=step is not None)
    fed: dict = {}  # partition 0's data stream's figures, also after a stop or a failure
    try:
        out = runner.run(feed)
    finally:
        if feed is not None:
            fed = feed.close()
    out["stall_fraction"], out["wait_seconds"] = fed.get("stall_fraction"), fed.get("wait_seconds")
    # what it pushed is held by every copy before the result counts (ack="replay")
    server.settle(checkpoint=False)
    if feed is not None:
        reporter.report(feed.done, runner.exchange.pushes, final=True)
        out["lr_end"] = runner.lr_end
        out["images_before"] = feed.share.images_before
        out["images_retrained"] = feed.retrained
        out["unreplicated_at_end"] = server.held()["unreplicated"]
    out["worker"] = worker.address
    out["threads"] = runner.threads
    out["stopped"] = bool(stop.is_set())
    return out


def cluster_plan(client: Any, net: Any, settings: Any, partitions: int) -> Any:
    """The partition plan of ``net`` for this cluster's TRAIN workers (their threads and
    memory limit), checked: :class:`~adam_dask.errors.PartitionError` names a partition that
    does not fit (before anything starts). With more than one partition the plan is logged."""
    import dask

    from ..cluster import workers_with_role
    from ..errors import PartitionError
    from ..model.engines import TORCH
    from ..model.partition import plan_partitions, whole_plan

    torch = getattr(net, "engine", None) == TORCH  # a user's nn.Module: no layer list to split
    if torch and partitions > 1:
        raise PartitionError(
            f"partitions={partitions}: a PyTorch model trains on one worker per replica",
            "train a torch model with partitions=1 (partitioning splits the numba engine's layers)",
        )
    unsupported = [
        what
        for what, on in (
            ("mode='sync'", settings.mode == "sync" and partitions > 1),
            ("offload_dense", settings.offload_dense and partitions > 1),
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
    window = dask.config.get("adam.train.partition-window")
    w = None if window is None else int(window)
    B = settings.batch_size
    if torch:  # the whole module, one stage
        plan = whole_plan(net.flat.size, threads=threads, batch_size=B, window=w)
    else:
        plan = plan_partitions(net, partitions, threads=threads, batch_size=B, window=w)
    if partitions > 1:
        logger.info("%s", plan.describe(budget))
    if budget is not None:
        plan.check(budget)
    return plan
