"""A replica's share of one epoch as the parameter server's marks leave it, written once for
partition 0 of every replica (:class:`~adam_dask.train._groups.ReplicaFeed`), whole or
partitioned.

A run of a replica (the first, or one after its worker was lost) reads every shard's marks
(:func:`~adam_dask.train._position.replica_plan`): first the stretches some shard misses, each
re-trained alone and pushed under its own number, then the rest of the share from where the
marks say, numbered on by a :class:`~adam_dask.train._position.Marker`. The schedule's progress
counts the images of the share done, those before this run included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ._position import Marker, Plan, Stretch, replica_plan

if TYPE_CHECKING:
    from ._handle import ReplicaServer

__all__ = ["Share", "ShareJob"]


class ShareJob(Protocol):
    """What a share is planned from (a :class:`~adam_dask.train.task.ReplicaJob`)."""

    @property
    def replica(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def share_images(self) -> int: ...
    @property
    def delay(self) -> float: ...


class Share:
    """Replica ``job.replica``'s share of epoch ``job.epoch``, planned from ``server``'s marks
    (``synchronous``: each push is a share of a synchronous step, its marks say so)."""

    def __init__(self, job: ShareJob, server: ReplicaServer, *, synchronous: bool = False):
        self.job = job
        self.plan: Plan = replica_plan(
            server.marks(job.epoch), job.epoch, job.replica, job.replicas
        )
        self.marker = Marker(
            job.epoch, job.replica, job.replicas, self.plan, synchronous=synchronous
        )

    @property
    def stretches(self) -> tuple[Stretch, ...]:
        """The stretches to re-train first, in order."""
        return self.plan.stretches

    @property
    def images_before(self) -> int:
        """Images of the share done before this run (held by some shard, or a stretch)."""
        return self.plan.images_done

    def progress(self, images: int) -> float:
        """The schedule's progress (epochs) once ``images`` of the share are done."""
        job = self.job
        return job.epoch + min(1.0, images / max(1, job.share_images))

    def stretch_stream(self, data: Any, stretch: Stretch) -> Any:
        """The data service ``data``'s stream of ``stretch``'s images, with their batches'
        keys (the caller closes it)."""
        job = self.job
        return data.stream(
            job.replica, job.replicas, job.epoch, return_key=True, only=stretch.items
        )

    def rest_stream(self, data: Any) -> Any:
        """The data service ``data``'s stream of the rest of the share, from where the marks
        say, with the batches' keys (the caller closes it)."""
        job = self.job
        return data.stream(
            job.replica, job.replicas, job.epoch, return_key=True, resume=self.marker.position
        )
