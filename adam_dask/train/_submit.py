"""Running one epoch's replicas on the cluster: submit, wait for the quorum, stop the rest.

The Dask side of the Trainer's epoch (the arithmetic is in ``_epoch.py``, the replica itself in
``task.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import config
from ..cluster import PS, TRAIN, workers_with_role
from ._epoch import quorum_size
from .task import BarrierRef, ReplicaJob, SyncBarrier, run_replica

if TYPE_CHECKING:
    from ._handle import ReplicaServer

__all__ = ["EpochRun", "run_replicas"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EpochRun:
    """What the replicas of one epoch returned."""

    results: list[dict]
    seconds: float
    quorum_seconds: float | None


def run_replicas(
    client: Any, jobs: Sequence[ReplicaJob], *, server: ReplicaServer, data: Any, quorum: float
) -> EpochRun:
    """Run ``jobs`` (one epoch, one per replica) until ``quorum`` of them finished; the others
    are stopped through the epoch's stop event. A replica's error stops the epoch and is
    raised."""
    from distributed import Event, as_completed

    first = jobs[0]
    R, epoch = len(jobs), first.epoch
    stop = Event(first.stop_name, client=client)
    stop.clear()
    barrier = barrier_future = None
    if first.settings.mode == "sync":
        host = workers_with_role(client, PS)[0]
        # the future is held until the epoch ends: released, the scheduler would forget the
        # actor and cancel the replicas that take it ("lost dependencies")
        barrier_future = client.submit(
            SyncBarrier,
            R,
            actor=True,
            workers=[host],
            allow_other_workers=False,
            key=f"adam-{first.run_id}-barrier-{epoch}",
        )
        barrier_future.result()  # the actor is up
        barrier = BarrierRef(host, barrier_future.key)
    t0 = time.perf_counter()
    # One graph for all replicas: the scheduler places them in one pass, each placement
    # raising its worker's occupancy, so they spread over the TRAIN workers. (Submitted one
    # by one, a replica that already seceded leaves its worker looking idle, and the next
    # could queue there behind the held TRAIN resource; pinning instead breaks the rerun of
    # a replica whose worker died.)
    futures = client.map(
        run_replica,
        list(jobs),
        server=server,
        data=data,
        barrier=barrier,
        resources={TRAIN: 1},
        pure=False,
        key=[f"adam-{job.run_id}-e{epoch}-r{job.replica}" for job in jobs],
    )
    needed = quorum_size(R, quorum)
    results: list[dict] = []
    quorum_seconds = None
    try:
        for fut in as_completed(futures):
            results.append(fut.result())
            logger.debug("replica result %s", results[-1])
            if len(results) == needed and needed < R:
                quorum_seconds = time.perf_counter() - t0
                logger.info("epoch %d: %d of %d replicas done; stopping the rest", epoch, needed, R)
                stop.set()
    except BaseException:
        # an error, or the user's interrupt: the replicas are seceded tasks that cancelling a
        # future does not stop, so they are told to stop and awaited (as the scheduler sees
        # them) before the stop is lifted; a new fit must not run beside them
        running = _stop_and_wait(futures, stop, float(config.get("train.stop-timeout")))
        for f in futures:  # forgotten, so a new fit runs the same keys again
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
    finally:
        if barrier_future is not None:
            barrier_future.release()
    return EpochRun(results, time.perf_counter() - t0, quorum_seconds)


def _stop_and_wait(futures: Sequence[Any], stop: Any, timeout: float) -> list[str]:
    """Set ``stop`` and wait until every replica task of ``futures`` ended (finished, erred or
    lost, by its future's state on the scheduler); returns the keys still running after
    ``timeout`` seconds."""
    from distributed import wait

    stop.set()
    try:
        wait(list(futures), timeout=timeout)
    except TimeoutError:
        pass
    return [f.key for f in futures if not f.done()]
