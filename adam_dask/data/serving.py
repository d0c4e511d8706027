"""Data serving (Project Adam section 3.1): DataServer actors on the DATA workers.

Each DATA worker runs one :class:`DataServer` actor that owns a *partition* of the dataset (a
contiguous, chunk-aligned range of images), reads it from the Zarr store by chunks (through
fsspec, so ``s3://`` works), keeps it in memory, and augments the next batches of every open
stream ahead of demand in background threads, into a bounded buffer per stream. A trainer
replica reads through a :class:`BatchStream`, which keeps a few ``next_batch`` requests in flight
(peer-to-peer actor calls) and yields ``(x, y)``.

Who gets which image
--------------------
Epoch ``e`` of replica ``r`` out of ``R``: every partition ``p`` is put in a random order drawn
from ``(seed, e, p)`` and cut into ``R`` consecutive, near-equal pieces; piece ``r`` of every
partition is replica ``r``'s share. The shares of replicas 0..R-1 therefore cover every image
exactly once per epoch, in a new order every epoch. Batch ``k`` of a piece holds its images
``k*B:(k+1)*B``; the stream interleaves the batches of all partitions in a random order.
An image's augmentation depends only on ``(seed, epoch, image index)``.

Memory
------
A partition that fits in ``cache_bytes`` is loaded whole (in the background) and stays in
memory. A larger one is ordered *chunk-windowed*: the chunks are shuffled, grouped into windows
that fit half the cache, and images are shuffled within a window; the server keeps an LRU of
chunks within the bound and reads the chunks of the next batches ahead (``read_ahead`` batches).

Failure
-------
Actors die with their worker. A stream whose server stops answering asks for the partition's
next *generation*: an actor keyed ``{service}-p{p}-g{n+1}`` (the same key for every stream that
notices, so only one is made), pinned to a live DATA worker and published as the Dask dataset
``{service}-p{p}`` (which also keeps it alive), where later streams and copies of the service
find it. If no DATA worker can take it within ``adam.serving.recover-timeout``, the stream serves
the rest of that partition itself (locally, in a background thread). The new server is opened
with the batch numbers the stream already received and produces only the others, so every image
of the share is delivered **exactly once**, and identically (the augmentation is deterministic).
Closing the service ends open streams with a :class:`~adam_dask.errors.ClusterError`.

Metrics
-------
``BatchStream.stats()``: images, batches, ``wait_seconds`` (time the consumer blocked in
``next``), ``elapsed_seconds`` (first ``next`` to the last batch) and ``stall_fraction`` (their
ratio; a replica that never waited for data reports ~0), recoveries. ``DataService.stats()``: per
server images served, batches made, open streams, ready batches and buffer occupancy, cache
bytes and chunk reads.

Example
-------
>>> service = DataService.create(client, "s3://bucket/mnist.zarr", augment=Augment(rotation=10))
>>> for x, y in service.stream(replica=0, replicas=2, epoch=0):  # doctest: +SKIP
...     ...
>>> service.close()  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future as _CFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import config
from ..cluster import DATA, workers_with_role
from ..errors import AdamError, ClusterError, ConfigError, DatasetError
from .augment import Augment, augment_batch
from .datasets import Split, open_split

logger = logging.getLogger(__name__)

__all__ = ["BatchStream", "DataServer", "DataService", "Layout", "PartitionServer", "load_arrays"]


# -- the layout: partitions, shares, batches (pure, no Dask) -----------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
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
        start, stop = self.partition(p)
        return (stop - start) * (replica + 1) // replicas - (stop - start) * replica // replicas


def _check_replica(replica: int, replicas: int, epoch: int) -> None:
    if not (isinstance(replicas, (int, np.integer)) and replicas >= 1):
        raise ConfigError(f"replicas={replicas!r} is invalid", "give the number of replicas (>= 1)")
    if not 0 <= replica < replicas:
        raise ConfigError(
            f"replica={replica} is outside 0..{replicas - 1}",
            "give a replica number below replicas",
        )
    if epoch < 0:
        raise ConfigError(f"epoch={epoch} is negative", "count epochs from 0")


# -- the chunk cache -------------------------------------------------------------------------------


class _ChunkCache:
    """A partition's images by Zarr chunk: an LRU within ``cache_bytes``, reads in a thread pool.

    Chunks are (n, H, W, C) uint8 arrays keyed by their global chunk number.
    """

    def __init__(self, split: Split, start: int, stop: int, cache_bytes: int, readers: int = 2):
        self.split, self.start, self.stop = split, start, stop
        self.chunk = split.chunk_images
        self.cache_bytes = int(cache_bytes)
        shape = split.image_shape
        self.hwc = (shape[0], shape[1], 1 if len(shape) == 2 else shape[2])
        self.chunk_bytes = self.chunk * int(np.prod(self.hwc))
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pending: dict[int, _CFuture] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="adam-data-read")
        self.reads = 0
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
        return np.ascontiguousarray(images.reshape((hi - lo,) + self.hwc))

    def prefetch(self, cids) -> None:
        """Start reading the chunks ``cids`` that are neither cached nor being read."""
        with self._lock:
            for cid in cids:
                if cid not in self._chunks and cid not in self._pending:
                    self._pending[cid] = self._pool.submit(self._read, cid)

    def _get_chunk(self, cid: int) -> np.ndarray:
        with self._lock:
            if cid in self._chunks:
                self._chunks.move_to_end(cid)
                return self._chunks[cid]
            fut = self._pending.get(cid)
            if fut is None:
                fut = self._pending[cid] = self._pool.submit(self._read, cid)
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
        return data

    def get(self, indices: np.ndarray) -> np.ndarray:
        """Images ``indices`` (global, inside the partition) -> (B, H, W, C) uint8."""
        out = np.empty((len(indices),) + self.hwc, np.uint8)
        cids = indices // self.chunk
        needed = np.unique(cids)
        self.prefetch(needed.tolist())
        for cid in needed.tolist():
            chunk = self._get_chunk(cid)
            sel = np.nonzero(cids == cid)[0]
            out[sel] = chunk[indices[sel] - cid * self.chunk]
        self._evict(set(needed.tolist()))
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


# -- the server core: threads, streams, bounded buffers (no Dask) ----------------------------------

_END = {"end": True}


@dataclass
class _StreamState:
    sid: str
    epoch: int
    batches: list[tuple[int, np.ndarray]]  # (batch number k, global indices) still to produce
    make: int = 0  # next position to produce
    out: int = 0  # next position to hand out
    ready: dict | None = None
    error: dict | None = None
    last_used: float = 0.0


class PartitionServer:
    """The thread-based core of a DataServer: one partition, any number of open streams.

    ``threads`` producer threads pick the open stream with the fewest ready batches and build
    its next batch (read from the chunk cache, augment with the GIL released); each stream's
    buffer holds at most ``buffer_batches`` ready batches, so an abandoned stream never holds
    the others back. Used in-process by a local :class:`BatchStream` and inside the actor.
    """

    def __init__(
        self,
        url: str,
        split: str,
        storage_options: dict | None,
        layout: Layout,
        partition: int,
        *,
        augment: Augment | None,
        seed: int,
        buffer_batches: int,
        cache_bytes: int,
        threads: int = 1,
        read_ahead: int = 2,
        notify=None,
        idle_timeout: float = 600.0,
    ):
        self.url, self.split_name, self.layout, self.partition = url, split, layout, partition
        self.augment = None if augment is None or augment.is_identity else augment
        self.seed, self.buffer_batches = int(seed), max(1, int(buffer_batches))
        self.read_ahead, self.idle_timeout = max(0, int(read_ahead)), float(idle_timeout)
        self._notify = notify
        self.start, self.stop = layout.partition(partition)
        self._split = open_split(url, split, storage_options)
        if len(self._split) != layout.n:
            raise DatasetError(
                f"{url}/{split} has {len(self._split)} images, but the service was "
                f"created for {layout.n}",
                "create the DataService again",
                url=url,
            )
        self.cache = _ChunkCache(self._split, self.start, self.stop, cache_bytes)
        self.cache_error: dict | None = None
        self.shape = self.cache.hwc
        self._cond = threading.Condition()
        self._streams: dict[str, _StreamState] = {}
        self._closed = False
        self.images_served = 0
        self.batches_served = 0
        self.batches_made = 0
        if layout.window_chunks is None:  # it fits: load the whole partition now
            self.cache.prefetch(list(self.cache.chunk_ids))
        self._warm = threading.Event()
        threading.Thread(
            target=self._warm_up, name=f"adam-data-p{partition}-warm", daemon=True
        ).start()
        self._threads = [
            threading.Thread(target=self._produce, name=f"adam-data-p{partition}-{i}", daemon=True)
            for i in range(max(1, int(threads)))
        ]
        for t in self._threads:
            t.start()

    def _warm_up(self) -> None:
        """Load the partition (when it fits) and the kernels, so the first batch is quick."""
        try:
            if self.layout.window_chunks is None:
                for cid in self.cache.chunk_ids:
                    self.cache._get_chunk(cid)
            if self.stop > self.start:
                self._make(0, 0, np.array([self.start], np.int64))
        except Exception as exc:  # surfaces, with the store's name, when a stream needs it
            logger.warning("partition %d: warm-up failed: %s", self.partition, exc)
        finally:
            self._warm.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the warm-up finished (True) or ``timeout`` passed (False)."""
        return self._warm.wait(timeout)

    # -- streams ---------------------------------------------------------------------------------

    def open_stream(
        self,
        sid: str,
        epoch: int,
        replica: int,
        replicas: int,
        batch_size: int,
        done: Sequence[int] = (),
    ) -> int:
        """Open stream ``sid``: replica's share of this partition in ``epoch``, minus the batch
        numbers in ``done`` (already delivered). Returns the number of batches to hand out."""
        _check_replica(replica, replicas, epoch)
        share = self.layout.share(self.partition, epoch, self.seed, replica, replicas)
        if self._closed:
            raise ClusterError(
                f"the DataServer of partition {self.partition} was shut down",
                "the DataService was closed; create a new one",
            )
        skip = set(int(k) for k in done)
        batches = [
            (k, share[i : i + batch_size])
            for k, i in enumerate(range(0, len(share), batch_size))
            if k not in skip
        ]
        with self._cond:
            self._streams[sid] = _StreamState(
                sid, epoch, batches, ready={}, last_used=time.monotonic()
            )
            self._cond.notify_all()
        logger.debug(
            "partition %d: stream %s opened (epoch %d, %d batches)",
            self.partition,
            sid,
            epoch,
            len(batches),
        )
        return len(batches)

    def close_stream(self, sid: str) -> bool:
        with self._cond:
            st = self._streams.pop(sid, None)
            self._cond.notify_all()
        return st is not None

    def try_take(self, sid: str) -> dict | None:
        """The stream's next batch, ``_END`` past its last one, ``None`` if not ready yet.

        A batch is ``{"k": batch number, "x": (B, C, H, W) float32, "y": (B,) int64,
        "idx": (B,) int64}``; an error is ``{"error": message, "hint": ..., "url": ...}``.
        """
        with self._cond:
            if self._closed:
                return {
                    "error": f"the DataServer of partition {self.partition} was shut down",
                    "hint": "the DataService was closed; create a new one",
                    "url": self.url,
                    "closed": True,
                }
            st = self._streams.get(sid)
            if st is None:
                return {
                    "error": f"stream {sid} is not open on partition {self.partition}",
                    "hint": "it was closed or expired; open a new stream",
                    "url": self.url,
                    "lost": True,
                }
            st.last_used = time.monotonic()
            if st.error is not None:
                return st.error
            if st.out >= len(st.batches):
                return _END
            item = st.ready.pop(st.out, None)
            if item is None:
                return None
            st.out += 1
            self.images_served += len(item["y"])
            self.batches_served += 1
            self._cond.notify_all()
            return item

    def take(self, sid: str, timeout: float | None = None) -> dict:
        """Blocking :meth:`try_take` (the in-process path)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                item = self.try_take(sid)
                if item is not None:
                    return item
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no batch from partition {self.partition} in {timeout} s")
                self._cond.wait(0.5 if left is None else min(0.5, left))

    # -- the producers -----------------------------------------------------------------------------

    def _claim(self) -> tuple[_StreamState, int] | None:
        best = None
        now = time.monotonic()
        for st in list(self._streams.values()):
            if now - st.last_used > self.idle_timeout:
                logger.info(
                    "partition %d: stream %s idle for %.0f s, released",
                    self.partition,
                    st.sid,
                    now - st.last_used,
                )
                del self._streams[st.sid]
                continue
            if st.error is not None or st.make >= len(st.batches):
                continue
            queued = st.make - st.out
            if queued < self.buffer_batches and (best is None or queued < best[0]):
                best = (queued, st)
        if best is None:
            return None
        st = best[1]
        pos = st.make
        st.make += 1
        return st, pos

    def _produce(self) -> None:
        while True:
            with self._cond:
                claim = None
                while not self._closed:
                    claim = self._claim()
                    if claim is not None:
                        break
                    self._cond.wait(1.0)
                if self._closed:
                    return
                st, pos = claim
                if self.layout.window_chunks is not None and self.read_ahead:
                    ahead = st.batches[pos + 1 : pos + 1 + self.read_ahead]
                else:
                    ahead = []
            try:
                if ahead:
                    self.cache.prefetch(
                        np.unique(
                            np.concatenate([i for _, i in ahead]) // self.cache.chunk
                        ).tolist()
                    )
                item = self._make(st.epoch, *st.batches[pos])
            except Exception as exc:
                logger.exception("partition %d: making a batch failed", self.partition)
                err = {
                    "error": str(exc)
                    if isinstance(exc, AdamError)
                    else f"serving {self.url} failed: {type(exc).__name__}: {exc}",
                    "url": getattr(exc, "url", None) or self.url,
                    "type": "DatasetError" if isinstance(exc, DatasetError) else "other",
                }
                with self._cond:
                    st.error = err
                    self._cond.notify_all()
                if self._notify is not None:
                    self._notify(st.sid)
                continue
            with self._cond:
                if self._streams.get(st.sid) is st:
                    st.ready[pos] = item
                    self.batches_made += 1
                self._cond.notify_all()
            if self._notify is not None:
                self._notify(st.sid)

    def _make(self, epoch: int, k: int, idx: np.ndarray) -> dict:
        images = self.cache.get(idx)
        H, W, C = self.shape
        if self.augment is None:
            # ship the stored bytes, (B, C, H, W) uint8: a quarter of float32's traffic; the
            # consumer scales them (BatchStream, as_float)
            x = np.ascontiguousarray(np.moveaxis(images.reshape(len(idx), H, W, C), 3, 1))
        else:
            x = np.empty((len(idx), C, H, W), np.float32)
            a = self.augment
            augment_batch(
                x,
                images,
                idx,
                self.seed & 0xFFFFFFFFFFFFFFFF,
                int(epoch),
                float(a.rotation),
                float(a.translation),
                float(a.scale),
                float(a.shear),
                float(a.elastic_alpha),
                float(a.elastic_sigma),
            )
        y = self.cache.labels[idx - self.start]
        return {"k": int(k), "x": x, "y": y, "idx": idx}

    # -- introspection and shutdown ----------------------------------------------------------------

    def stats(self) -> dict:
        with self._cond:
            ready = sum(len(st.ready) for st in self._streams.values())
            streams = len(self._streams)
        capacity = streams * self.buffer_batches
        return {
            "partition": self.partition,
            "images": self.stop - self.start,
            "images_served": self.images_served,
            "batches_served": self.batches_served,
            "batches_made": self.batches_made,
            "streams": streams,
            "buffered_batches": ready,
            "buffer_capacity": capacity,
            "buffer_occupancy": ready / capacity if capacity else 0.0,
            "cached_images": self.cache.cached_images,
            "cached_bytes": self.cache.nbytes,
            "cache_bytes": self.cache.cache_bytes,
            "chunk_reads": self.cache.reads,
        }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._streams.clear()
            self._cond.notify_all()
        self.cache.close()


# -- the actor -------------------------------------------------------------------------------------


class DataServer:
    """A Dask actor wrapping :class:`PartitionServer`; every method is ``async`` (event loop),
    the work runs in the core's own threads. Create it through :meth:`DataService.create`."""

    def __init__(self, *args, **kwargs):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._core = PartitionServer(*args, notify=self._notify, **kwargs)

    def _notify(self, sid: str) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake, sid)
            except RuntimeError:  # the loop closed: the worker is shutting down
                pass

    def _wake(self, sid: str) -> None:
        ev = self._events.get(sid)
        if ev is not None:
            ev.set()

    async def open(
        self,
        sid: str,
        epoch: int,
        replica: int,
        replicas: int,
        batch_size: int,
        done: list[int] | None = None,
    ) -> int:
        self._loop = asyncio.get_running_loop()
        self._events[sid] = asyncio.Event()
        return self._core.open_stream(sid, epoch, replica, replicas, batch_size, done or ())

    async def next_batch(self, sid: str) -> dict:
        """The next batch of stream ``sid`` (waits for the producer when none is ready)."""
        while True:
            ev = self._events.get(sid)
            if ev is not None:
                ev.clear()
            item = self._core.try_take(sid)
            if item is not None:
                return item
            if ev is None:  # opened before a restart of this object: cannot happen, be safe
                await asyncio.sleep(0.01)
            else:
                await ev.wait()

    async def close_stream(self, sid: str) -> bool:
        self._events.pop(sid, None)
        return self._core.close_stream(sid)

    async def stats(self) -> dict:
        return self._core.stats()

    async def ready(self, timeout: float | None = None) -> bool:
        """Wait (off the event loop) until the partition and the kernels are loaded."""
        return await asyncio.to_thread(self._core.wait_ready, timeout)

    async def ping(self) -> int:
        return self._core.partition

    async def shutdown(self) -> None:
        self._core.close()


# -- sources: where a stream gets one partition's batches --------------------------------------------


def as_float(x: np.ndarray) -> np.ndarray:
    """A batch as the model takes it: uint8 (B, C, H, W) becomes float32 in [0, 1], exactly as
    :func:`~adam_dask.data.augment.to_float_batch` computes it; float32 passes through."""
    if x.dtype == np.uint8:
        return (x / 255.0).astype(np.float32)
    return x


def _result(req, timeout: float | None):
    """``req.result(timeout)``, without the event-loop round trip when it is already done.

    ``ActorFuture.result`` always syncs with the event loop (~1 ms from a task thread); a
    finished one holds its outcome in ``_out`` (distributed 2024+). Falls back to ``result``.
    """
    out = getattr(req, "_out", None) if getattr(req, "done", None) and req.done() else None
    if out is not None and hasattr(out, "unwrap"):
        return out.unwrap()
    return req.result(timeout=timeout)


class _ActorSource:
    def __init__(self, actor, gen: int, sid: str):
        self.actor, self.gen, self.sid = actor, gen, sid

    def request(self):
        return self.actor.next_batch(self.sid)

    def close(self) -> None:
        try:
            self.actor.close_stream(self.sid)  # fire and forget
        except Exception:
            pass


class _LocalRequest:
    def __init__(self, server: PartitionServer, sid: str):
        self.server, self.sid = server, sid

    def result(self, timeout: float | None = None) -> dict:
        return self.server.take(self.sid, timeout)


class _LocalSource:
    gen = -1

    def __init__(self, server: PartitionServer, sid: str):
        self.server, self.sid = server, sid

    def request(self):
        return _LocalRequest(self.server, self.sid)

    def close(self) -> None:
        self.server.close()


# -- the service ------------------------------------------------------------------------------------


def _parse_gen(key: str) -> int:
    return int(str(key).rsplit("-g", 1)[1])


class DataService:
    """The data-serving layer of one dataset split: one :class:`DataServer` per DATA worker.

    Create it with :meth:`create`. It pickles (actor handles travel), so a replica task on a
    TRAIN worker calls :meth:`stream` itself and talks to the servers peer-to-peer.
    """

    def __init__(
        self,
        *,
        name: str,
        url: str,
        split: str,
        storage_options: dict | None,
        layout: Layout,
        augment: Augment | None,
        seed: int,
        batch_size: int,
        buffer_batches: int,
        cache_bytes: int,
        threads: int,
        read_ahead: int,
        input_shape: tuple[int, int, int],
        num_classes: int,
        actors: list | None,
        futures: list | None = None,
    ):
        self.name, self.url, self.split = name, url, split
        self.storage_options = storage_options
        self.layout, self.augment, self.seed = layout, augment, int(seed)
        self.batch_size, self.buffer_batches = int(batch_size), int(buffer_batches)
        self.cache_bytes, self.threads, self.read_ahead = (
            int(cache_bytes),
            int(threads),
            int(read_ahead),
        )
        self.input_shape, self.num_classes = tuple(input_shape), int(num_classes)
        self._actors = actors  # None: local serving (no DATA workers)
        self._gens = [0] * layout.partitions
        self._futures = futures or []  # driver side only: keeps the actors alive
        self._closed = False

    # -- creation -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        client,
        url: str,
        *,
        split: str = "train",
        storage_options: dict | None = None,
        augment: Augment | bool | None = None,
        seed: int = 0,
        batch_size: int | None = None,
        buffer_batches: int | None = None,
        cache_bytes: int | None = None,
        threads: int | None = None,
        timeout: float | None = None,
        wait: bool = True,
    ) -> DataService:
        """Start serving split ``split`` of the store at ``url``.

        One :class:`DataServer` actor per DATA worker (pinned to it), each owning a partition;
        with no DATA workers (``client`` may also be ``None``) streams serve locally.

        Parameters
        ----------
        augment : Augment, bool or None
            The augmentation; ``None`` follows ``adam.augment`` (``enabled`` decides), ``False``
            means none, ``True`` means ``Augment.from_config()``.
        seed : int
            Seeds the epoch orders and the augmentation (with epoch and image index).
        batch_size, buffer_batches, cache_bytes, threads
            Default to ``adam.serving.batch-size``, ``buffer-batches`` (ready batches per stream),
            ``cache-bytes`` (in-memory bound per server) and ``threads`` (producers per server).
        timeout : float
            Seconds to wait for the actors (``adam.serving.create-timeout``).
        wait : bool
            Wait until every server has loaded its partition (when it fits the cache) and its
            kernels, so the first epoch does not start with a stall.
        """
        if augment is None:
            augment = Augment.default()
        elif augment is True:
            augment = Augment.from_config()
        elif augment is False:
            augment = None
        elif not isinstance(augment, Augment):
            raise ConfigError(
                f"augment={augment!r} is not an Augment",
                "pass adam_dask.data.Augment(...), True, False or None",
            )
        batch_size = int(config.get("serving.batch-size", batch_size))
        buffer_batches = int(config.get("serving.buffer-batches", buffer_batches))
        cache_bytes = int(config.get("serving.cache-bytes", cache_bytes))
        threads = int(config.get("serving.threads", threads))
        read_ahead = int(config.get("serving.read-ahead"))
        timeout = float(config.get("serving.create-timeout", timeout))
        for name, v in (
            ("batch_size", batch_size),
            ("buffer_batches", buffer_batches),
            ("threads", threads),
        ):
            if v < 1:
                raise ConfigError(
                    f"{name}={v} must be at least 1",
                    f"set it or adam.serving.{name.replace('_', '-')}",
                )
        if cache_bytes < 0:
            raise ConfigError(
                f"cache_bytes={cache_bytes} is negative",
                "give a byte count (adam.serving.cache-bytes)",
            )

        s = open_split(url, split, storage_options)  # a clear DatasetError for a bad store
        if len(s) == 0:
            raise DatasetError(f"{s.url}/{split} holds no images", "ingest some data", url=s.url)
        workers = workers_with_role(client, DATA) if client is not None else []
        partitions = max(1, len(workers))
        chunk = s.chunk_images
        image_bytes = int(np.prod(s.image_shape))
        layout = Layout(len(s), chunk, partitions)
        biggest = max(b - a for a, b in (layout.partition(p) for p in range(partitions)))
        if biggest * image_bytes > cache_bytes:
            window = max(1, cache_bytes // (2 * chunk * image_bytes))
            layout = Layout(len(s), chunk, partitions, window)
            logger.info(
                "a partition (%d MB) exceeds cache_bytes=%d: chunk-windowed order, %d "
                "chunks per window",
                biggest * image_bytes >> 20,
                cache_bytes,
                window,
            )
        name = f"adam-data-{uuid.uuid4().hex[:10]}"
        service = cls(
            name=name,
            url=s.url,
            split=split,
            storage_options=storage_options,
            layout=layout,
            augment=augment,
            seed=seed,
            batch_size=batch_size,
            buffer_batches=buffer_batches,
            cache_bytes=cache_bytes,
            threads=threads,
            read_ahead=read_ahead,
            input_shape=s.input_shape,
            num_classes=s.num_classes,
            actors=None,
        )
        if not workers:
            logger.info("no DATA workers: %s is served locally by each stream", s.url)
            return service
        futures = [
            client.submit(
                DataServer,
                *service._server_args(p),
                key=service._key(p, 0),
                actor=True,
                workers=[addr],
                allow_other_workers=False,
                **service._server_kwargs(),
            )
            for p, addr in enumerate(workers)
        ]
        try:
            actors = [f.result(timeout=timeout) for f in futures]
        except DatasetError:
            client.cancel(futures)
            raise
        except Exception as exc:
            client.cancel(futures)
            raise ClusterError(
                f"the DataServers did not start within {timeout} s: {type(exc).__name__}: {exc}",
                "check the DATA workers (memory, logs) or raise adam.serving.create-timeout",
            ) from exc
        if wait:
            try:
                warm = [a.ready(timeout) for a in actors]
                for w in warm:
                    w.result(timeout=timeout + 5)
            except Exception as exc:
                logger.warning("the DataServers did not finish warming up: %s", exc)
        for p, f in enumerate(futures):
            client.publish_dataset(**{service._var(p): f}, override=True)
        service._actors, service._futures = actors, futures
        logger.info("serving %s/%s from %d DataServers (%s)", s.url, split, len(actors), name)
        return service

    @staticmethod
    def _published(client, name: str):
        """The future published as ``name`` (a Dask published dataset), or None."""
        return client.get_dataset(name, default=None)

    def _key(self, p: int, gen: int) -> str:
        return f"{self.name}-p{p}-g{gen}"

    def _var(self, p: int) -> str:
        return f"{self.name}-p{p}"

    def _server_args(self, p: int) -> tuple:
        return (self.url, self.split, self.storage_options, self.layout, p)

    def _server_kwargs(self) -> dict:
        return {
            "augment": self.augment,
            "seed": self.seed,
            "buffer_batches": self.buffer_batches,
            "cache_bytes": self.cache_bytes,
            "threads": self.threads,
            "read_ahead": self.read_ahead,
            "idle_timeout": float(config.get("serving.idle-timeout")),
        }

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_futures"] = []
        return state

    # -- properties ---------------------------------------------------------------------------------

    @property
    def local(self) -> bool:
        """True when streams serve locally (no DATA workers)."""
        return self._actors is None

    def __len__(self) -> int:
        return self.layout.n

    def servers(self) -> list[str]:
        """The worker address of each partition's DataServer (as this copy knows it)."""
        if self.local:
            return []
        return [a._address for a in self._actors]

    def stream(
        self,
        replica: int = 0,
        replicas: int = 1,
        epoch: int = 0,
        batch_size: int | None = None,
        *,
        prefetch: int | None = None,
        return_index: bool = False,
    ) -> BatchStream:
        """Replica ``replica``'s share (of ``replicas``) of epoch ``epoch``, as a
        :class:`BatchStream` of ``(x float32 (B, C, H, W) in [0, 1], y int64 (B,))``
        (``(x, y, idx)`` with ``return_index``, idx the global image indices)."""
        if self._closed:
            raise ClusterError(f"the DataService {self.name} is closed", "create a new one")
        _check_replica(replica, replicas, epoch)
        bs = int(batch_size or self.batch_size)
        if bs < 1:
            raise ConfigError(f"batch_size={bs} must be at least 1", "give a positive batch size")
        return BatchStream(
            self,
            replica,
            replicas,
            epoch,
            bs,
            prefetch=int(config.get("serving.prefetch", prefetch)),
            return_index=return_index,
        )

    # -- generations ------------------------------------------------------------------------------

    def _current(self, p: int):
        """(actor, gen) currently published for partition ``p`` (refreshes this copy)."""
        from distributed import get_client

        try:
            fut = self._published(get_client(), self._var(p))
            if fut is None:
                raise ClusterError(f"the DataService {self.name} was closed", "create a new one")
            gen = _parse_gen(fut.key)
            if gen > self._gens[p] and fut.status != "error":
                self._actors[p] = fut.result(timeout=float(config.get("serving.recover-timeout")))
                self._gens[p] = gen
        except ClusterError:
            raise
        except Exception as exc:  # the scheduler is unreachable: use what this copy knows
            logger.debug("partition %d: no published generation (%s)", p, exc)
        return self._actors[p], self._gens[p]

    def _replacement(self, p: int, failed_gen: int):
        """A live DataServer for partition ``p`` newer than ``failed_gen``, or None."""
        from distributed import get_client

        client = get_client()
        timeout = float(config.get("serving.recover-timeout"))
        gen = failed_gen
        for _ in range(2):  # a second try covers a target that died meanwhile
            fut = self._published(client, self._var(p))
            if fut is None:  # create() always publishes: it was closed since
                raise ClusterError(
                    f"the DataService {self.name} was closed while a stream read from it",
                    "close streams before the service",
                )
            try:
                pub = _parse_gen(fut.key)
                if pub > gen and fut.status != "error":
                    actor = fut.result(timeout=timeout)
                    self._actors[p], self._gens[p] = actor, pub
                    return actor, pub
                gen = max(gen, pub)
            except Exception as exc:
                logger.debug("partition %d: no usable published generation (%s)", p, exc)
            gen += 1
            workers = workers_with_role(client, DATA)
            if not workers:
                return None
            addr = workers[(p + gen) % len(workers)]
            logger.warning("partition %d: starting DataServer generation %d on %s", p, gen, addr)
            fut = client.submit(
                DataServer,
                *self._server_args(p),
                key=self._key(p, gen),
                actor=True,
                workers=[addr],
                allow_other_workers=False,
                **self._server_kwargs(),
            )
            try:
                actor = fut.result(timeout=timeout)
            except DatasetError:
                raise
            except Exception as exc:
                logger.warning("partition %d: generation %d did not start: %s", p, gen, exc)
                continue
            client.publish_dataset(**{self._var(p): fut}, override=True)
            self._actors[p], self._gens[p] = actor, gen
            return actor, gen
        return None

    # -- stats, close ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Per-server figures (images served, buffer occupancy, cache) and totals."""
        if self.local:
            return {"servers": [], "images_served": 0, "local": True}
        servers = []
        futs = []
        for p in range(self.layout.partitions):
            try:
                actor, _ = self._current(p)
                futs.append((p, actor.stats()))
            except Exception as exc:
                servers.append({"partition": p, "error": str(exc)})
        for p, f in futs:
            try:
                servers.append(f.result(timeout=30))
            except Exception as exc:
                servers.append({"partition": p, "error": f"{type(exc).__name__}: {exc}"})
        servers.sort(key=lambda d: d["partition"])
        return {
            "servers": servers,
            "local": False,
            "images_served": sum(s.get("images_served", 0) for s in servers),
            "buffer_occupancy": [s.get("buffer_occupancy") for s in servers],
        }

    def close(self) -> None:
        """Stop the servers and release the actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.local:
            return
        from distributed import get_client

        try:
            client = get_client()
        except ValueError:
            return
        for p in range(self.layout.partitions):
            try:
                actor, _ = self._current(p)
                actor.shutdown().result(timeout=10)
            except Exception as exc:
                logger.debug("partition %d: shutdown failed (%s)", p, exc)
            try:
                client.unpublish_dataset(self._var(p))
            except Exception:
                pass
        for f in self._futures:  # with the datasets unpublished, the actors are released
            f.release()
        self._futures = []

    def __enter__(self) -> DataService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "local" if self.local else f"{self.layout.partitions} DataServers"
        return f"<DataService {self.name} {self.url}/{self.split}: {self.layout.n} images, {where}>"


# -- the client-side stream --------------------------------------------------------------------------


class BatchStream:
    """One replica's share of one epoch; iterate for ``(x, y)`` batches.

    Keeps ``prefetch`` requests in flight. ``len(stream)`` is the number of batches,
    ``stream.images`` the images in the share. Stop early with :meth:`close` (it releases the
    servers' state for this stream; other streams never wait for it). :meth:`stats` reports
    what was served and how long the consumer waited (``stall_fraction``).
    """

    def __init__(
        self,
        service: DataService,
        replica: int,
        replicas: int,
        epoch: int,
        batch_size: int,
        *,
        prefetch: int = 3,
        return_index: bool = False,
    ):
        self.service, self.replica, self.replicas, self.epoch = service, replica, replicas, epoch
        self.batch_size, self.prefetch = batch_size, max(1, prefetch)
        self.return_index = return_index
        self.sid = f"{service.name}-e{epoch}-r{replica}of{replicas}-{uuid.uuid4().hex[:8]}"
        lay = service.layout
        self._counts = [
            math.ceil(lay.share_size(p, replica, replicas) / batch_size)
            for p in range(lay.partitions)
        ]
        self.images = sum(lay.share_size(p, replica, replicas) for p in range(lay.partitions))
        rng = np.random.default_rng([service.seed & 0xFFFFFFFF, epoch, replica, replicas, 0x5EED])
        self._schedule = rng.permutation(
            np.repeat(np.arange(lay.partitions), self._counts)
        ).tolist()
        self._pos = 0
        self._pending: deque = deque()
        self._received: list[set[int]] = [set() for _ in range(lay.partitions)]
        self._sources: dict[int, Any] = {}
        self._closed = False
        self._call_timeout = float(config.get("serving.call-timeout"))
        self.wait_seconds = 0.0
        self.images_delivered = 0
        self.batches_delivered = 0
        self.recoveries = 0
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._open_sources()

    # -- sources ------------------------------------------------------------------------------------

    def _open_args(self, p: int):
        return (
            self.sid,
            self.epoch,
            self.replica,
            self.replicas,
            self.batch_size,
            sorted(self._received[p]),
        )

    def _open_sources(self) -> None:
        parts = [p for p, c in enumerate(self._counts) if c > 0]
        if self.service.local:
            for p in parts:
                self._sources[p] = self._local_source(p)
            return
        opening = []
        for p in parts:
            try:
                actor, gen = self.service._current(p)
                opening.append((p, actor, gen, actor.open(*self._open_args(p))))
            except Exception as exc:
                self._sources[p] = self._recover(p, exc, gen=self.service._gens[p])
        for p, actor, gen, fut in opening:
            try:
                fut.result(timeout=self._call_timeout)
                self._sources[p] = _ActorSource(actor, gen, self.sid)
            except DatasetError:
                raise
            except Exception as exc:
                self._sources[p] = self._recover(p, exc, gen=gen)

    def _local_source(self, p: int) -> _LocalSource:
        svc = self.service
        server = PartitionServer(
            svc.url, svc.split, svc.storage_options, svc.layout, p, **svc._server_kwargs()
        )
        server.open_stream(*self._open_args(p))
        return _LocalSource(server, self.sid)

    def _recover(self, p: int, exc: BaseException, gen: int):
        """A new source for partition ``p`` after its server failed with ``exc``."""
        self.recoveries += 1
        logger.warning(
            "stream %s: the DataServer of partition %d (generation %d) failed (%s: %s); "
            "recovering with %d batches already received",
            self.sid,
            p,
            gen,
            type(exc).__name__,
            exc,
            len(self._received[p]),
        )
        try:
            found = self.service._replacement(p, gen)
            if found is not None:
                actor, new_gen = found
                actor.open(*self._open_args(p)).result(timeout=self._call_timeout)
                return _ActorSource(actor, new_gen, self.sid)
        except (DatasetError, ClusterError):
            raise
        except Exception as exc2:
            logger.warning(
                "stream %s: no replacement DataServer for partition %d (%s: %s)",
                self.sid,
                p,
                type(exc2).__name__,
                exc2,
            )
        logger.warning("stream %s: serving partition %d locally", self.sid, p)
        return self._local_source(p)

    # -- iteration ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._schedule)

    def __iter__(self) -> Iterator:
        return self

    def _fill(self) -> None:
        while len(self._pending) < self.prefetch and self._pos < len(self._schedule):
            p = self._schedule[self._pos]
            self._pos += 1
            self._issue(p)

    def _issue(self, p: int) -> None:
        src = self._sources[p]
        try:
            self._pending.append((p, src, src.request()))
        except Exception as exc:  # the handle knows its worker is gone
            self._pending.append((p, src, _Failed(exc)))

    def __next__(self):
        if self._closed:
            raise StopIteration
        if self._t_first is None:
            self._t_first = time.perf_counter()
        self._fill()
        while self._pending:
            p, src, req = self._pending.popleft()
            t0 = time.perf_counter()
            try:
                item = _result(req, self._call_timeout)
                failure = None
            except DatasetError:
                raise
            except Exception as exc:
                item, failure = None, exc
            self.wait_seconds += time.perf_counter() - t0
            if failure is None and item.get("closed"):
                self.close()
                raise ClusterError(item["error"], item.get("hint"))
            if (
                failure is None
                and item.get("lost")
                and isinstance(src, _ActorSource)
                and self._sources.get(p) is src
            ):
                # the server is alive but dropped this stream (idle-timeout): open it again
                dropped = [e for e in self._pending if e[0] == p]
                self._pending = deque(e for e in self._pending if e[0] != p)
                logger.warning(
                    "stream %s: partition %d dropped the stream; reopening it", self.sid, p
                )
                try:
                    src.actor.open(*self._open_args(p)).result(timeout=self._call_timeout)
                except Exception as exc:
                    self._pending.extend(dropped)
                    self._replace(p, src, exc)
                    continue
                for _ in range(1 + len(dropped)):
                    self._issue(p)
                continue
            if failure is None and item.get("lost"):
                failure = RuntimeError(item["error"])
            elif failure is None and "error" in item:
                self._raise(item)
            if failure is None and item.get("end"):
                failure = RuntimeError("the server ran out of batches early")
            if failure is not None:
                if self._sources.get(p) is src:
                    self._replace(p, src, failure)
                else:  # an old request of an already-replaced source: ask the new one
                    self._issue(p)
                continue
            k = item["k"]
            if k in self._received[p]:
                logger.warning(
                    "stream %s: batch %d of partition %d received twice; dropped", self.sid, k, p
                )
                self._issue(p)
                continue
            self._received[p].add(k)
            self.batches_delivered += 1
            self.images_delivered += len(item["y"])
            self._fill()
            self._t_last = time.perf_counter()
            x = as_float(item["x"])
            if self.return_index:
                return x, item["y"], item["idx"]
            return x, item["y"]
        self._finish()
        raise StopIteration

    def _replace(self, p: int, src, failure: BaseException) -> None:
        lost = [e for e in self._pending if e[0] == p]
        self._pending = deque(e for e in self._pending if e[0] != p)
        try:
            src.close()
        except Exception:
            pass
        t0 = time.perf_counter()
        self._sources[p] = self._recover(p, failure, gen=src.gen)
        self.wait_seconds += time.perf_counter() - t0
        for _ in range(1 + len(lost)):
            self._issue(p)

    def _raise(self, item: dict) -> None:
        self.close()
        raise DatasetError(item["error"], item.get("hint"), url=item.get("url"))

    def _finish(self) -> None:
        if not self._closed:
            self._closed = True
            for src in self._sources.values():
                src.close()
            self._pending.clear()

    def close(self) -> None:
        """Stop early: release this stream's state on every server (does not wait)."""
        self._finish()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._finish()
        except Exception:
            pass

    def stats(self) -> dict:
        """images, batches, wait_seconds, elapsed_seconds, stall_fraction, recoveries."""
        elapsed = 0.0
        if self._t_first is not None:
            elapsed = (self._t_last or time.perf_counter()) - self._t_first
        return {
            "images": self.images_delivered,
            "batches": self.batches_delivered,
            "share_images": self.images,
            "share_batches": len(self),
            "wait_seconds": self.wait_seconds,
            "elapsed_seconds": elapsed,
            "stall_fraction": self.wait_seconds / elapsed if elapsed > 0 else 0.0,
            "recoveries": self.recoveries,
        }


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def result(self, timeout=None):
        raise self.exc


# -- evaluation reads --------------------------------------------------------------------------------


def load_arrays(
    url: str,
    split: str = "test",
    storage_options: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All of split ``split`` in memory: (images uint8 (N, H, W[, C]), labels int64 (N,)).

    For evaluation; pass the images through :func:`adam_dask.data.augment.as_model_input` for
    the model's (N, C, H, W) float32 input. Errors name the store.
    """
    s = open_split(url, split, storage_options)
    images, labels = s.read(0, len(s))
    return images, labels.astype(np.int64)
