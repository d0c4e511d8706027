"""The pure arithmetic of an epoch: how many replicas, when the quorum is reached, the record.

No Dask: the Trainer (trainer.py) does the I/O and calls these.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ..errors import ClusterError, ConfigError
from ._result import ReplicaResult

__all__ = [
    "epoch_record",
    "quorum_size",
    "replica_count",
    "say_epoch",
    "share_sizes",
]

logger = logging.getLogger(__name__)


def replica_count(fixed: int | None, train_workers: int) -> int:
    """Replicas for the next epoch: ``fixed``, or one per TRAIN worker present now (elastic)."""
    if train_workers < 1 and fixed is None:
        raise ClusterError(
            "the cluster has no TRAIN workers",
            "start workers with --resources TRAIN=1 or use adam_dask.cluster.assign_roles",
        )
    if fixed is None:
        return train_workers
    if fixed < 1:
        raise ConfigError(f"replicas={fixed}", "use at least one replica, or 'auto'")
    if fixed > train_workers:
        logger.warning(
            "%d replicas on %d TRAIN workers: replicas queue for a worker", fixed, train_workers
        )
    return fixed


def quorum_size(replicas: int, quorum: float) -> int:
    """Replicas whose end ends the epoch: ``ceil(quorum * replicas)``, at least one."""
    return max(1, math.ceil(quorum * replicas - 1e-9))


def share_sizes(images: int, replicas: int) -> list[int]:
    """About each replica's images of an epoch (for the schedule's progress)."""
    return [images * (r + 1) // replicas - images * r // replicas for r in range(replicas)]


def epoch_record(
    epoch: int,
    results: Sequence[ReplicaResult],
    *,
    replicas: int,
    seconds: float,
    quorum_seconds: float | None,
    flush_seconds: float,
    accuracy: float,
    ps_before: dict,
    ps_after: dict,
    lr: float,
    lr_end: float,
    mode: str,
    images_applied: int | None = None,
) -> dict:
    """The history record of one epoch from the results of its replicas (whole or partitioned
    alike: a field one kind does not measure counts as nothing from it); ``images_applied``:
    the images whose updates the parameter server applied (its data positions)."""
    images = sum(r.images for r in results)
    loss = sum(r.loss * r.images for r in results if r.images) / images if images else float("nan")
    # shard updates applied by the primaries during the epoch
    pushes = ps_after.get("pushes_applied", 0) - ps_before.get("pushes_applied", 0)
    replica_seconds = sum(r.seconds for r in results)
    pushes_made = sum(r.pushes for r in results)
    ps_seconds = sum(r.ps_seconds for r in results)
    images_pushed = sum(r.images_pushed for r in results)
    return {
        "epoch": epoch,
        "loss": loss,
        "test_accuracy": accuracy,
        "images": images,
        "images_pushed": images_pushed,
        "images_applied": images_applied,
        "images_retrained": sum(r.images_retrained or 0 for r in results),
        "images_per_second": images / seconds if seconds else 0.0,
        "seconds": seconds,
        "quorum_seconds": quorum_seconds,
        "flush_seconds": flush_seconds,
        "stall_fraction": max((r.stall_fraction or 0.0 for r in results), default=0.0),
        "ps_updates_per_second": pushes / seconds if seconds else 0.0,
        "ps_fraction": ps_seconds / replica_seconds if replica_seconds else 0.0,
        "replication_lag": ps_after.get("max_replication_lag"),
        "writeback_lag": ps_after.get("writeback_lag_seconds"),
        "writeback_lag_versions": ps_after.get("writeback_lag_versions"),
        "replicas_finished": sum(not r.stopped for r in results),
        "replicas": replicas,
        # a partitioned replica's workers joined by commas, in partition order
        "replica_workers": sorted(",".join(r.workers) for r in results),
        "replica_threads": sorted(r.threads for r in results),
        # the rate each replica stepped with last, as it ran (the schedule, scaled for R, damped
        # where its pushes covered more than the plan's period)
        "replica_lr_end": sorted(r.lr_end for r in results),
        # images per push and seconds per exchange (push and pull) over the replicas' pushes,
        # and the damping each replica's last rate carried (below 1: it pushed less often
        # than planned)
        "push_images": images_pushed / pushes_made if pushes_made else None,
        "exchange_seconds": ps_seconds / pushes_made if pushes_made else None,
        "replica_damping": sorted(1.0 if r.damping is None else r.damping for r in results),
        # pushes some copy still lacked when a replica's result came back: 0, as each replica
        # settles before it returns (images_applied then counts durable pushes only)
        "unreplicated_at_end": sum(r.unreplicated_at_end or 0 for r in results),
        # a partitioned replica's activations and errors between its partitions (0 otherwise)
        "cross_partition_bytes": sum(r.cross_bytes for r in results),
        "lr": lr,
        "lr_end": lr_end,
        "mode": mode,
    }


def say_epoch(record: dict, num_classes: int, lr: float) -> None:
    """Log an epoch's record; a warning when its accuracy is at chance level (of
    ``num_classes``): the run at learning rate ``lr`` has stopped learning."""
    logger.info(
        "epoch %d: loss %.4f, test accuracy %.4f, %.0f images/s, %d replicas",
        record["epoch"],
        record["loss"],
        record["test_accuracy"],
        record["images_per_second"],
        record["replicas"],
    )
    if record["test_accuracy"] <= 1.5 / num_classes:
        logger.warning(
            "epoch %d: test accuracy %.3f is at chance level: the model has "
            "stopped learning (diverged?); lower the learning rate (lr=%g) "
            "or push_every, or use fewer replicas",
            record["epoch"],
            record["test_accuracy"],
            lr,
        )
