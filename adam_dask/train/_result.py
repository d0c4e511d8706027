"""What one replica did in one epoch: :class:`ReplicaResult`, returned for a whole-model replica
(:func:`~adam_dask.train.task.run_replica`) and for a partitioned one (its partitions' results
combined by :mod:`._partitioned`) alike, and read by the epoch's record
(:func:`~adam_dask.train._epoch.epoch_record`) alone. Pure: no Dask.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplicaResult"]


@dataclass(frozen=True, slots=True)
class ReplicaResult:
    """One replica's epoch, whole or over partitions.

    The fields after ``cross_bytes`` are measured by one kind of replica only, and are None
    for the other (the epoch's record reads None as a replica that added nothing to them).
    """

    replica: int
    epoch: int
    images: int  # trained, re-trained stretches included
    images_pushed: int  # in its pushes (partitioned: the fewest any of its partitions pushed)
    loss: float  # the mean training loss over its images (nan without images)
    seconds: float  # whole: the task's run; partitioned: from the epoch's start to its end
    train_seconds: float  # training (partitioned: the longest partition's run)
    pushes: int  # pushes made (partitioned: summed over its partitions, a push each)
    ps_seconds: float  # waiting for push and pull (partitioned: the longest partition's)
    stopped: bool  # the epoch's quorum stopped it before its share was done
    workers: tuple[str, ...]  # where it ran: its TRAIN worker, or one per partition in order
    threads: int  # Hogwild threads (partitioned: each partition's)
    lr_end: float  # the rate it stepped with last (partitioned: the schedule's at the end)
    partitions: int = 1
    cross_bytes: int = 0  # activations and error terms sent between its partitions
    # whole-model replicas only: a partitioned replica counts its re-trained stretches in
    # ``images``, and its partition 0's data stream and rate are not measured
    images_retrained: int | None = None  # the stretches some shard missed, trained again
    images_before: int | None = None  # images of its share done before this run
    stall_fraction: float | None = None  # its data stream's time blocked / time running
    wait_seconds: float | None = None  # its data stream's time blocked
    damping: float | None = None  # the damping lr_end carries (1: pushed as planned)
    unreplicated_at_end: int | None = None  # its pushes some copy lacked when it returned
    # partitioned replicas only
    attempts: int | None = None  # runs of its partitions (a lost partition runs them again)
