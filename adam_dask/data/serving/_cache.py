"""A partition's images by Zarr chunk: an LRU bounded in bytes, chunks read in a thread pool.

No Dask: the chunk cache of a :class:`~adam_dask.data.serving._partition.PartitionServer`,
inside a DataServer actor or in-process when a stream serves a partition itself.

A partition that fits the bound (MNIST's does, whole) is read into one array, its chunks views
of it, and once every chunk is in, a batch is one gather (``np.take``) instead of a pass per
chunk it touches: a shuffled batch of 64 touches ~55 of MNIST's 235 chunks, and that loop was
most of a DataServer's CPU per batch (benchmarks/data_capacity.py).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ...errors import DatasetError
from ..datasets import Split

logger = logging.getLogger(__name__)

__all__ = ["ChunkCache"]


class ChunkCache:
    """Images ``[start, stop)`` of ``split`` by chunk: (n, H, W, C) uint8 arrays keyed by their
    global chunk number, at most ``cache_bytes`` of them kept (least recently used go first),
    read by ``readers`` threads. The labels of the range are read at once."""

    def __init__(self, split: Split, start: int, stop: int, *, cache_bytes: int, readers: int):
        self.split, self.start, self.stop = split, start, stop
        self.chunk = split.chunk_images
        self.cache_bytes = int(cache_bytes)
        shape = split.image_shape
        self.hwc = (shape[0], shape[1], 1 if len(shape) == 2 else shape[2])
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, readers), thread_name_prefix="adam-data-read")
        self.reads = 0
        # the whole range in one array when it fits (chunk-aligned, as a layout's partitions
        # are): chunks are views of it, never evicted, and a batch is one gather once all are in
        self._whole: np.ndarray | None = None
        if start % self.chunk == 0 and (stop - start) * math.prod(self.hwc) <= self.cache_bytes:
            self._whole = np.empty((stop - start, *self.hwc), np.uint8)
        self._complete = False
        try:
            self.labels = np.asarray(split.labels[start:stop]).astype(np.int64)
        except Exception as exc:
            raise DatasetError(
                f"cannot read labels {start}:{stop} of {split.url}/{split.name}: "
                f"{type(exc).__name__}: {exc}",
                "the store is damaged; ingest it again",
                url=split.url,
            ) from exc

    @property
    def chunk_ids(self) -> range:
        return range(self.start // self.chunk, math.ceil(self.stop / self.chunk))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._chunks.values())

    @property
    def cached_images(self) -> int:
        with self._lock:
            return sum(c.shape[0] for c in self._chunks.values())

    def _read(self, cid: int) -> np.ndarray:
        lo, hi = cid * self.chunk, min(self.stop, (cid + 1) * self.chunk)
        images, _ = self.split.read(lo, hi)  # DatasetError names the store on failure
        self.reads += 1
        images = images.reshape((hi - lo, *self.hwc))
        whole = self._whole
        if whole is None:
            return np.ascontiguousarray(images)
        view = whole[lo - self.start : hi - self.start]
        view[...] = images
        return view

    def prefetch(self, cids: Iterable[int]) -> None:
        """Start reading the chunks ``cids`` that are neither cached nor being read."""
        with self._lock:
            for cid in cids:
                if cid not in self._chunks and cid not in self._pending:
                    self._pending[cid] = self._pool.submit(self._read, cid)

    def load(self, cid: int) -> np.ndarray:
        """Chunk ``cid``, from the cache or read now: a read still queued behind a prefetch
        is taken out of the queue and done in this thread, so what a batch needs comes first
        (a read in flight is waited for)."""
        mine: Future | None = None
        with self._lock:
            if cid in self._chunks:
                self._chunks.move_to_end(cid)
                return self._chunks[cid]
            fut = self._pending.get(cid)
            if fut is None or fut.cancel():
                fut = mine = self._pending[cid] = Future()
                mine.set_running_or_notify_cancel()  # running: no other thread cancels it
        if mine is not None:
            try:
                mine.set_result(self._read(cid))
            except BaseException as exc:  # raised below, and to any thread waiting on it
                mine.set_exception(exc)
        try:
            data = fut.result()
        except BaseException:
            with self._lock:
                if self._pending.get(cid) is fut:
                    del self._pending[cid]
            raise
        with self._lock:
            self._pending.pop(cid, None)
            self._chunks[cid] = data
            self._chunks.move_to_end(cid)
            if self._whole is not None and len(self._chunks) == len(self.chunk_ids):
                self._complete = True  # every chunk in, none ever evicted: the fits-whole case
        return data

    def get(self, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Images ``indices`` (global, inside the range) -> (B, H, W, C) uint8, into ``out``
        when given."""
        if out is None:
            out = np.empty((len(indices), *self.hwc), np.uint8)
        whole = self._whole if self._complete else None
        if whole is not None:
            return np.take(whole, indices - self.start, axis=0, out=out)
        cids = indices // self.chunk
        needed = np.unique(cids).tolist()
        self.prefetch(needed)
        for cid in needed:
            chunk = self.load(cid)
            sel = np.nonzero(cids == cid)[0]
            out[sel] = chunk[indices[sel] - cid * self.chunk]
        self._evict(set(needed))
        return out

    def _evict(self, keep: set[int]) -> None:
        with self._lock:
            total = sum(c.nbytes for c in self._chunks.values())
            for cid in list(self._chunks):
                if total <= self.cache_bytes:
                    break
                if cid not in keep:
                    total -= self._chunks.pop(cid).nbytes

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._chunks.clear()
            self._complete = False
            self._whole = None
