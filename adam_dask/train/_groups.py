"""Partition 0's push groups: the replica's stream cut into groups of whole mini-batches,
each pushed by every partition as one push (part ``p`` of it from partition ``p``).

:func:`push_groups` cuts a stream into groups of about ``push_every`` images, numbered and
marked in order (a :class:`~adam_dask.train._position.Marker`); :func:`replica_groups` is what
partition 0 feeds its pipeline with: first the stretches some shard misses (each re-trained
alone, one group under its own number), then the rest of the share. The runner
(:mod:`._pipeline`) only takes the groups in order.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._position import encode
from ._share import Share
from .streams import resolve_push_every

if TYPE_CHECKING:
    from ._handle import ReplicaServer
    from .replica import Flag
    from .task import ReplicaJob

__all__ = ["Group", "minibatches", "push_groups", "replica_groups"]


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


def push_groups(
    items: Iterable[tuple[np.ndarray, np.ndarray, Any]],
    batch_size: int,
    push_every: int,
    marks: Callable[[dict], tuple[int, list]],
) -> Iterator[Group]:
    """Groups of the stream ``items`` ((x, y, key) batches): whole mini-batches of up to
    ``batch_size`` until at least ``push_every`` images, the last group what is left.
    ``marks(items)`` ({key: images}) numbers a group and says what it covers (a
    :class:`~adam_dask.train._position.Marker`'s next mark, committed at once: the group
    is formed in order)."""
    batches: list[tuple[np.ndarray, np.ndarray]] = []
    counts: dict[Any, int] = {}
    n = 0
    for xs, ys, key in minibatches(items, batch_size):
        batches.append((xs, ys))
        counts[key] = counts.get(key, 0) + len(ys)
        n += len(ys)
        if n >= push_every:
            seq, covers = marks(counts)
            yield Group(seq, covers, batches)
            batches, counts, n = [], {}, 0
    if batches:
        seq, covers = marks(counts)
        yield Group(seq, covers, batches)


def replica_groups(
    rj: ReplicaJob,
    server: ReplicaServer,
    data: Any,
    stop: Flag,
    report: Callable[[int], None],
    stream_stats: dict | None = None,
) -> Generator[Group, None, None]:
    """Partition 0's push groups of replica ``rj``'s share: the stretches the shards' marks
    say to re-train (a :class:`~adam_dask.train._share.Share`), each one group under its
    number, then the rest of the share from the data service ``data``; ``report(images)`` as
    each group leaves (the replica's progress events). Stops between groups once ``stop`` is
    set. ``stream_stats`` receives the share's data stream's figures when it closes (its
    ``stats()``: the time the replica waited on it among them)."""
    s = rj.settings
    share = Share(rj, server)
    marker = share.marker
    done = share.images_before

    for stretch in share.stretches:
        if stop.is_set():
            return
        stream = share.stretch_stream(data, stretch)
        try:
            group = Group(
                stretch.seq, encode(stretch.items), lr=rj.schedule.at(share.progress(done))
            )
            group.batches = [(x, y) for x, y, _ in minibatches(stream, s.batch_size)]
        finally:
            stream.close()
        yield group
    if stop.is_set():
        return
    stream = share.rest_stream(data)

    def marks(counts: dict) -> tuple[int, list]:
        m = marker.marks(counts, 1)[0]
        marker.commit(m)
        return m.seq, m.covers

    try:
        every = resolve_push_every(s.push_every, rj.replicas)  # the trainer's plan set it
        for group in push_groups(stream, s.batch_size, every, marks):
            group.lr = rj.schedule.at(share.progress(done))
            done += group.images
            yield group
            report(done)
    finally:
        if stream_stats is not None:
            stream_stats.update(stream.stats())
        stream.close()
