"""What partition 0 feeds its replica with, in push groups of whole mini-batches, each group
pushed by every partition as one push (part ``p`` of it from partition ``p``).

A :class:`ReplicaFeed` gives first the stretches some shard misses (each re-trained alone, one
fixed :class:`Group` under its own number), then the rest of the share as mini-batches; the
runner (:mod:`._pipeline`) cuts the rest into groups as it feeds them, a group closing once it
holds ``push_every`` images and the exchange is free, and the feed numbers and marks each
group in order (a :class:`~adam_dask.train._position.Marker`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._position import encode
from ._share import Share
from .streams import resolve_push_every

if TYPE_CHECKING:
    from ._handle import ReplicaServer
    from .task import ReplicaJob

__all__ = ["Feed", "Group", "ReplicaFeed", "minibatches"]


@dataclass(slots=True)
class Group:
    """A push group: mini-batches ``(x, y)`` whose updates every partition pushes as push
    ``seq`` covering ``covers`` (encoded ranges of the replica's data)."""

    seq: int
    covers: list
    batches: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    lr: float = 0.0

    @property
    def images(self) -> int:
        return sum(len(y) for _, y in self.batches)


def minibatches(
    items: Iterable[tuple[np.ndarray, np.ndarray, Any]], batch_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]:
    """The stream ``items`` ((x, y, key) batches) cut into mini-batches of up to
    ``batch_size`` images, in order, each with its batch's key."""
    for x, y, key in items:
        for a in range(0, len(y), batch_size):
            yield x[a : a + batch_size], y[a : a + batch_size], key


class Feed(Protocol):
    """What partition 0 feeds its replica from: the fixed groups first (the stretches some
    shard misses, each re-trained alone under its number), then the rest of the share as
    mini-batches, cut into push groups as they are fed (:class:`ReplicaFeed`, or a test's)."""

    push_every: int  # images a group holds at least before it closes (the paper's k)

    def stretches(self) -> Iterator[Group]: ...

    def rest(self) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]: ...

    def lr(self) -> float: ...

    def cut(self, counts: dict, images: int) -> tuple[int, list]: ...


class ReplicaFeed:
    """Partition 0's feed of replica ``rj``'s share (a :class:`Feed`): the stretches the
    shards' marks say to re-train (a :class:`~adam_dask.train._share.Share`), then the rest of
    the share from the data service ``data`` in mini-batches of ``batch_size``.

    :meth:`cut` numbers a group of the rest and says what it covers (the
    :class:`~adam_dask.train._position.Marker`'s next mark, committed at once: groups close in
    order) and reports the replica's progress (``report(images)``); :meth:`lr` is the
    schedule's rate at the share's progress. :meth:`close` closes the rest's stream and
    returns its figures (``stats()``: the time the replica waited on it among them; {} before
    the rest began). ``synchronous``: each push is a share of a synchronous step (its marks say
    so)."""

    def __init__(
        self,
        rj: ReplicaJob,
        server: ReplicaServer,
        data: Any,
        report: Callable[[int], None],
        *,
        synchronous: bool = False,
    ):
        self.job, self.data, self.report = rj, data, report
        self.share = Share(rj, server, synchronous=synchronous)
        self.done = self.share.images_before
        self.push_every = resolve_push_every(rj.settings.push_every, rj.replicas)
        self.retrained = 0  # images of the stretches fed
        self._stream: Any = None

    def stretches(self) -> Iterator[Group]:
        share, batch = self.share, self.job.settings.batch_size
        for stretch in share.stretches:
            stream = share.stretch_stream(self.data, stretch)
            try:
                group = Group(stretch.seq, encode(stretch.items), lr=self.lr())
                group.batches = [(x, y) for x, y, _ in minibatches(self._slowed(stream), batch)]
            finally:
                stream.close()
            self.retrained += group.images
            yield group

    def rest(self) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]:
        self._stream = self.share.rest_stream(self.data)
        yield from minibatches(self._slowed(self._stream), self.job.settings.batch_size)

    def _slowed(self, stream: Iterable[Any]) -> Iterator[Any]:
        """``stream``'s batches, each after ``job.delay`` seconds of sleep when set (a
        deliberately slow replica, for straggler and fault experiments)."""
        for item in stream:
            if self.job.delay:
                time.sleep(self.job.delay)
            yield item

    def lr(self) -> float:
        return self.job.schedule.at(self.share.progress(self.done))

    def cut(self, counts: dict, images: int) -> tuple[int, list]:
        marker = self.share.marker
        m = marker.marks(counts, 1)[0]
        marker.commit(m)
        self.done += images
        self.report(self.done)
        return m.seq, m.covers

    def close(self) -> dict:
        if self._stream is None:
            return {}
        stats = dict(self._stream.stats())
        self._stream.close()
        return stats
