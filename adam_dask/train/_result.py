"""What one replica did in one epoch: :class:`ReplicaResult`, its partitions' results combined
(:func:`~adam_dask.train._partitioned.combine`; a whole model is one partition), read by the
epoch's record (:func:`~adam_dask.train._epoch.epoch_record`) alone. Pure: no Dask.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplicaResult"]


@dataclass(frozen=True, slots=True)
class ReplicaResult:
    """One replica's epoch, over its partitions (one for a whole model): what partition 0 fed
    and measured (its share, its data stream, its rate), and each partition's work summed or
    at its longest. A field None: not measured in this run (its stream never opened)."""

    replica: int
    epoch: int
    images: int  # trained, re-trained stretches included
    images_pushed: int  # in its pushes (the fewest any of its partitions pushed)
    loss: float  # the mean training loss over its images (nan without images)
    seconds: float  # from the epoch's start to its end
    train_seconds: float  # training (the longest partition's run)
    pushes: int  # pushes made (summed over its partitions, a push each)
    ps_seconds: float  # waiting for push and pull (the longest partition's)
    stopped: bool  # the epoch's quorum stopped it before its share was done
    workers: tuple[str, ...]  # where it ran: one TRAIN worker per partition, in order
    threads: int  # Hogwild threads (each partition's)
    lr_end: float  # the rate it fed its last group at
    partitions: int = 1
    cross_bytes: int = 0  # activations and error terms sent between its partitions
    images_retrained: int | None = None  # the stretches some shard missed, trained again
    images_before: int | None = None  # images of its share done before this run
    stall_fraction: float | None = None  # its data stream's time blocked / time running
    wait_seconds: float | None = None  # its data stream's time blocked
    damping: float | None = None  # the damping lr_end carries (1: pushed as planned)
    unreplicated_at_end: int | None = None  # its pushes some copy lacked when it returned
    attempts: int | None = None  # runs of its partitions (a lost one runs them all again)
