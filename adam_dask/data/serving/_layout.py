"""Who gets which image: a split cut into partitions, an epoch into shares (pure, no Dask).

Epoch ``e`` of replica ``r`` out of ``R``: every partition ``p`` is put in a random order drawn
from ``(seed, e, p)`` and cut into ``R`` consecutive, near-equal pieces; piece ``r`` of every
partition is replica ``r``'s share. The shares of replicas 0..R-1 therefore cover every image
exactly once per epoch, in a new order every epoch. Batch ``k`` of a piece holds its images
``k*B:(k+1)*B``; a stream interleaves the batches of all partitions in a random order.

A partition that fits the cache is shuffled as a whole. A larger one is ordered
*chunk-windowed*: its chunks are shuffled, grouped into windows of ``window_chunks`` chunks, and
the images are shuffled within a window, so a server reads each chunk about once per epoch.

>>> lay = PartitionLayout(n=1000, chunk=64, partitions=2)
>>> lay.partition(0), lay.partition(1)
((0, 512), (512, 1000))
>>> shares = [lay.share(p, epoch=0, seed=0, replica=r, replicas=3) for p in (0, 1) for r in range(3)]
>>> sorted(int(i) for s in shares for i in s) == list(range(1000))
True
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["PartitionLayout", "batch_plan", "check_share"]


@dataclass(frozen=True, slots=True)
class PartitionLayout:
    """How a split is cut into partitions and an epoch into shares (the same on every party).

    n: images in the split; chunk: images per Zarr chunk; partitions: number of DataServers;
    window_chunks: ``None`` when a partition fits the cache (fully random order), else the
    number of chunks shuffled together (chunk-windowed order).
    """

    n: int
    chunk: int
    partitions: int
    window_chunks: int | None = None

    def partition(self, p: int) -> tuple[int, int]:
        """Image range [start, stop) of partition ``p``: whole chunks, near-equal counts."""
        chunks = math.ceil(self.n / self.chunk)
        c0, c1 = p * chunks // self.partitions, (p + 1) * chunks // self.partitions
        return min(self.n, c0 * self.chunk), min(self.n, c1 * self.chunk)

    def order(self, p: int, epoch: int, seed: int) -> np.ndarray:
        """Partition ``p``'s images (global indices, int64) in epoch ``epoch``'s order."""
        start, stop = self.partition(p)
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), int(p), 0xADA])
        if self.window_chunks is None:
            return start + rng.permutation(stop - start).astype(np.int64)
        first, last = start // self.chunk, math.ceil(stop / self.chunk)
        chunks = first + rng.permutation(last - first)
        parts = []
        for w in range(0, len(chunks), self.window_chunks):
            idx = np.concatenate(
                [
                    np.arange(c * self.chunk, min(stop, (c + 1) * self.chunk))
                    for c in chunks[w : w + self.window_chunks]
                ]
            )
            parts.append(rng.permutation(idx))
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def share(self, p: int, epoch: int, seed: int, replica: int, replicas: int) -> np.ndarray:
        """Replica ``replica``'s piece of partition ``p`` in epoch ``epoch`` (global indices)."""
        start, stop = self.partition(p)
        lo = (stop - start) * replica // replicas
        hi = (stop - start) * (replica + 1) // replicas
        return self.order(p, epoch, seed)[lo:hi]

    def share_size(self, p: int, replica: int, replicas: int) -> int:
        """Images in replica ``replica``'s piece of partition ``p`` (the same every epoch)."""
        start, stop = self.partition(p)
        return (stop - start) * (replica + 1) // replicas - (stop - start) * replica // replicas


def batch_plan(
    layout: PartitionLayout, replica: int, replicas: int, epoch: int, batch_size: int, seed: int
) -> tuple[list[int], list[int]]:
    """(batches per partition, the order in which a stream asks the partitions for them).

    The order is a random interleaving drawn from ``(seed, epoch, replica, replicas)``.
    """
    counts = [
        math.ceil(layout.share_size(p, replica, replicas) / batch_size)
        for p in range(layout.partitions)
    ]
    rng = np.random.default_rng([seed & 0xFFFFFFFF, epoch, replica, replicas, 0x5EED])
    schedule = rng.permutation(np.repeat(np.arange(layout.partitions), counts)).tolist()
    return counts, schedule


def check_share(replica: int, replicas: int, epoch: int) -> None:
    """A :class:`~adam_dask.errors.ConfigError` unless ``replica`` of ``replicas`` in ``epoch``
    names a share."""
    if not (isinstance(replicas, int | np.integer) and replicas >= 1):
        raise ConfigError(f"replicas={replicas!r} is invalid", "give the number of replicas (>= 1)")
    if not 0 <= replica < replicas:
        raise ConfigError(
            f"replica={replica} is outside 0..{replicas - 1}",
            "give a replica number below replicas",
        )
    if epoch < 0:
        raise ConfigError(f"epoch={epoch} is negative", "count epochs from 0")
