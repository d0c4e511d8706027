"""The core of a DataServer, without Dask: one partition, any number of open streams.

A :class:`PartitionServer` owns a partition of a split (a chunk-aligned image range), keeps it
in a :class:`~._cache.ChunkCache`, and builds the next batches of every open stream ahead of
demand in its own producer threads, into a bounded buffer per stream. It answers
:meth:`~PartitionServer.try_take` with the messages of :mod:`._messages`. The DataServer actor
wraps one; a stream whose servers are gone runs one in-process.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import config
from ...errors import AdamError, ClusterError, ConfigError, DatasetError
from ..augment import Augment, augment_batch
from ..datasets import open_split
from ._cache import ChunkCache
from ._layout import PartitionLayout, check_share
from ._messages import Batch, End, Message, ServerClosed, ServingError, StreamExpired

logger = logging.getLogger(__name__)

__all__ = ["PartitionServer", "ServerSettings"]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How a partition server works; :meth:`from_config` fills what is not given from
    ``adam.serving``. ``augment`` is ``None`` for none."""

    augment: Augment | None
    seed: int
    buffer_batches: int
    cache_bytes: int
    threads: int
    read_ahead: int
    readers: int
    idle_timeout: float

    @classmethod
    def from_config(
        cls,
        *,
        augment: Augment | None,
        seed: int | None = None,
        buffer_batches: int | None = None,
        cache_bytes: int | None = None,
        threads: int | None = None,
    ) -> ServerSettings:
        s = cls(
            augment=None if augment is None or augment.is_identity else augment,
            seed=int(config.get("serving.seed", seed)),
            buffer_batches=int(config.get("serving.buffer-batches", buffer_batches)),
            cache_bytes=int(config.get("serving.cache-bytes", cache_bytes)),
            threads=int(config.get("serving.threads", threads)),
            read_ahead=int(config.get("serving.read-ahead")),
            readers=int(config.get("serving.readers")),
            idle_timeout=float(config.get("serving.idle-timeout")),
        )
        for name in ("buffer_batches", "threads", "readers"):
            if getattr(s, name) < 1:
                raise ConfigError(
                    f"{name}={getattr(s, name)} must be at least 1",
                    f"set it or adam.serving.{name.replace('_', '-')}",
                )
        if not s.idle_timeout > 0:
            raise ConfigError(
                f"idle_timeout={s.idle_timeout} must be positive",
                "give seconds (adam.serving.idle-timeout)",
            )
        if s.cache_bytes < 0 or s.read_ahead < 0:
            raise ConfigError(
                f"cache_bytes={s.cache_bytes}, read_ahead={s.read_ahead}: neither may be negative",
                "give byte and batch counts (adam.serving.cache-bytes, read-ahead)",
            )
        return s


@dataclass(slots=True)
class _StreamState:
    sid: str
    epoch: int
    batches: list[tuple[int, np.ndarray]]  # (batch number k, global indices) still to produce
    make: int = 0  # next position to produce
    out: int = 0  # next position to hand out
    ready: dict[int, Batch] = field(default_factory=dict)
    error: ServingError | None = None
    last_used: float = 0.0
    # where the stream's batches are made: an image plane's shared slots (None: new arrays)
    alloc: Callable[[tuple[int, ...], Any], np.ndarray | None] | None = None
    # what a blocked take() of this stream waits on (on the server's lock): woken by news of
    # this stream only, not by every batch of every stream
    cond: threading.Condition = field(default_factory=threading.Condition)


_live: weakref.WeakSet[PartitionServer] = weakref.WeakSet()
_live_lock = threading.Lock()
_exit_hook = False
_exiting = False


def _close_live() -> None:
    """When the process ends: close the partitions still serving, and refuse new ones.

    A process ends (a worker closed by its nanny, a job stopped by SIGTERM) with the producer
    threads, daemons, still reading; the exit stops the thread pools their reads run on (the
    cache's, then zarr's at ``atexit``), and a read under way fails. Closing the partitions
    first lets their producers stop quietly. A daemon thread that still runs (a replica task
    going on to its next stream) may ask for a partition after this: it gets a ClusterError
    that says the process is ending, not a read failure that blames the store.
    """
    global _exiting
    with _live_lock:
        _exiting = True
        live = list(_live)
    if live:
        logger.info("closing %d data partition(s) at exit", len(live))
    for server in live:
        server.close(ending=True)


def _ending(partition: int) -> ClusterError:
    return ClusterError(
        f"the DataServer of partition {partition} was not started: this process is ending",
        "nothing to do; the process that asked for it is shutting down",
    )


def _track(server: PartitionServer) -> bool:
    """Close ``server`` when the process ends; False (do not start it) when it is ending."""
    global _exit_hook
    with _live_lock:
        if _exiting:
            return False
        if not _exit_hook:
            # concurrent.futures stops every thread pool in a hook threading runs before it
            # joins the threads, earlier than atexit; hooks run newest first, so this one, added
            # after concurrent.futures' (imported by now), runs before it
            register = getattr(threading, "_register_atexit", atexit.register)
            register(_close_live)
            _exit_hook = True
        _live.add(server)
        return True


class PartitionServer:
    """Partition ``partition`` of split ``split`` of the store at ``url``, served to streams.

    ``settings.threads`` producer threads pick the open stream with the fewest ready batches
    and build its next batch (read from the chunk cache, augment with the GIL released); each
    stream's buffer holds at most ``settings.buffer_batches`` ready batches, so an abandoned
    stream never holds the others back, and a stream nobody reads for ``idle_timeout`` seconds
    is dropped. ``notify(sid)`` is called (from a producer thread) when stream ``sid`` has news.
    """

    def __init__(
        self,
        url: str,
        split: str,
        storage_options: dict | None,
        layout: PartitionLayout,
        partition: int,
        settings: ServerSettings,
        *,
        notify: Callable[[str], None] | None = None,
    ):
        self.url, self.split_name, self.layout, self.partition = url, split, layout, partition
        self.settings = settings
        self._notify = notify
        self.start, self.stop = layout.partition(partition)
        if _exiting:  # the exit began: the pools reads run on are going or gone
            raise _ending(partition)
        self._split = open_split(url, split, storage_options)
        if len(self._split) != layout.n:
            raise DatasetError(
                f"{url}/{split} has {len(self._split)} images, but the service was "
                f"created for {layout.n}",
                "create the DataService again",
                url=url,
            )
        self.cache = ChunkCache(
            self._split,
            self.start,
            self.stop,
            cache_bytes=settings.cache_bytes,
            readers=settings.readers,
        )
        self.shape = self.cache.hwc
        # one lock; the producers wait on _cond, a stream's takers on its own condition
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._streams: dict[str, _StreamState] = {}
        self._closed = False
        self.ending = False  # closed because this process ends (close(ending=True))
        self.images_served = 0
        self.batches_served = 0
        self.batches_made = 0
        self.transport = {"plane": 0, "dask": 0}  # batches handed out, by how they travelled
        self._warm = threading.Event()
        if not _track(self):  # the process began to end while the store was opened
            self.cache.close()
            raise _ending(partition)
        if layout.window_chunks is None:  # it fits: load the whole partition now
            self.cache.prefetch(self.cache.chunk_ids)
        threading.Thread(
            target=self._warm_up, name=f"adam-data-p{partition}-warm", daemon=True
        ).start()
        for i in range(settings.threads):
            threading.Thread(
                target=self._produce, name=f"adam-data-p{partition}-{i}", daemon=True
            ).start()

    def _warm_up(self) -> None:
        """Load the kernels (while the readers read) and the partition (when it fits), so the
        first batch is quick."""
        try:
            if self.settings.augment is not None:  # loading the kernels takes ~1 s of CPU
                self._augment(np.zeros((1, *self.shape), np.uint8), np.zeros(1, np.int64), 0)
            if self.layout.window_chunks is None:
                for cid in self.cache.chunk_ids:
                    self.cache.load(cid)
        except Exception as exc:  # surfaces, with the store's name, when a stream needs it
            if not self._closed:
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
        *,
        alloc: Callable[[tuple[int, ...], Any], np.ndarray | None] | None = None,
    ) -> int:
        """Open stream ``sid``: replica's share of this partition in ``epoch``, minus the batch
        numbers in ``done`` (already delivered). Returns the number of batches to hand out.
        ``alloc(shape, dtype)``, when given, supplies the array each batch's images are made in
        (``None`` from it: a new array)."""
        check_share(replica, replicas, epoch)
        if self._closed:
            raise self._closed_message().exception()
        share = self.layout.share(self.partition, epoch, self.settings.seed, replica, replicas)
        skip = {int(k) for k in done}
        batches = [
            (k, share[i : i + batch_size])
            for k, i in enumerate(range(0, len(share), batch_size))
            if k not in skip
        ]
        cond = threading.Condition(self._lock)
        with self._cond:
            old = self._streams.get(sid)
            self._streams[sid] = _StreamState(
                sid, epoch, batches, last_used=time.monotonic(), alloc=alloc, cond=cond
            )
            if old is not None:  # a take() blocked on the stream it replaces looks again
                old.cond.notify_all()
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
            if st is not None:
                st.cond.notify_all()  # a blocked take() sees StreamExpired
        return st is not None

    def try_take(self, sid: str) -> Message | None:
        """The stream's next :class:`Batch`, :class:`End` past its last one, an error message,
        or ``None`` when the next batch is not ready yet."""
        with self._cond:
            if self._closed:
                return self._closed_message()
            st = self._streams.get(sid)
            if st is None:
                return StreamExpired(f"stream {sid} is not open on partition {self.partition}")
            st.last_used = time.monotonic()
            if st.error is not None:
                return st.error
            if st.out >= len(st.batches):
                return End()
            item = st.ready.pop(st.out, None)
            if item is None:
                return None
            st.out += 1
            self.images_served += len(item)
            self.batches_served += 1
            self._cond.notify_all()  # room in its buffer: the producers
            return item

    def take(self, sid: str, timeout: float | None = None) -> Message:
        """Blocking :meth:`try_take` (the in-process path); ``TimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                item = self.try_take(sid)
                if item is not None:
                    return item
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no batch from partition {self.partition} in {timeout} s")
                self._streams[sid].cond.wait(left)  # open: try_take said so

    # -- the producers -----------------------------------------------------------------------------

    def _claim(self) -> tuple[_StreamState, int] | None:
        """The stream with the fewest ready batches that wants more, and its next position."""
        best: tuple[int, _StreamState] | None = None
        now = time.monotonic()
        for st in list(self._streams.values()):
            if now - st.last_used > self.settings.idle_timeout:
                logger.info(
                    "partition %d: stream %s idle for %.0f s, released",
                    self.partition,
                    st.sid,
                    now - st.last_used,
                )
                del self._streams[st.sid]
                st.cond.notify_all()  # a blocked take() sees StreamExpired
                continue
            if st.error is not None or st.make >= len(st.batches):
                continue
            queued = st.make - st.out
            if queued < self.settings.buffer_batches and (best is None or queued < best[0]):
                best = (queued, st)
        if best is None:
            return None
        st = best[1]
        st.make += 1
        return st, st.make - 1

    def _produce(self) -> None:
        while True:
            # nothing of the last batch is kept while waiting: its images may be in a reader's
            # shared segment, which must be unmapped when that reader's connection ends
            st = item = None
            with self._cond:
                claim = None
                while not self._closed:
                    claim = self._claim()
                    if claim is not None:
                        break
                    # woken by every change; the timeout only lets idle streams expire
                    self._cond.wait(self.settings.idle_timeout / 2)
                if self._closed or claim is None:
                    return
                st, pos = claim
                ahead: list[tuple[int, np.ndarray]] = []
                if self.layout.window_chunks is not None:
                    ahead = st.batches[pos + 1 : pos + 1 + self.settings.read_ahead]
            try:
                if ahead:
                    idx = np.concatenate([i for _, i in ahead])
                    self.cache.prefetch(np.unique(idx // self.cache.chunk).tolist())
                item = self._make(st.epoch, *st.batches[pos], alloc=st.alloc)
            except Exception as exc:
                if self._closed:  # close() stopped the cache under this producer
                    return
                logger.exception("partition %d: making a batch failed", self.partition)
                with self._cond:
                    st.error = self._error(exc)
                    st.cond.notify_all()
                self._tell(st.sid)
                continue
            with self._cond:
                if self._streams.get(st.sid) is st:
                    st.ready[pos] = item
                    self.batches_made += 1
                st.cond.notify_all()
            self._tell(st.sid)

    def count_transport(self, how: str) -> None:
        """One batch handed out ``how`` (``"plane"`` or ``"dask"``)."""
        with self._cond:
            self.transport[how] += 1

    def _tell(self, sid: str) -> None:
        if self._notify is not None:
            self._notify(sid)

    def _error(self, exc: Exception) -> ServingError:
        if isinstance(exc, AdamError):
            return ServingError(exc.message, exc.hint, getattr(exc, "url", None) or self.url)
        return ServingError(
            f"serving {self.url} failed: {type(exc).__name__}: {exc}",
            "see the DATA worker's log",
            self.url,
        )

    def _make(
        self,
        epoch: int,
        k: int,
        idx: np.ndarray,
        alloc: Callable[[tuple[int, ...], Any], np.ndarray | None] | None = None,
    ) -> Batch:
        y = self.cache.labels[idx - self.start]
        H, W, C = self.shape
        if self.settings.augment is None:  # ship the stored bytes: a quarter of float32's traffic
            out = None if alloc is None else alloc((len(idx), H, W, C), np.uint8)
            return Batch(int(k), self.cache.get(idx, out=out), y, idx)
        images = self.cache.get(idx)
        out = None if alloc is None else alloc((len(idx), C, H, W), np.float32)
        return Batch(int(k), self._augment(images, idx, epoch, out=out), y, idx)

    def _augment(
        self, images: np.ndarray, idx: np.ndarray, epoch: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """(B, H, W, C) uint8 -> (B, C, H, W) float32, augmented (the GIL released), into
        ``out`` when given."""
        a = self.settings.augment
        assert a is not None
        H, W, C = self.shape
        x = np.empty((len(idx), C, H, W), np.float32) if out is None else out
        augment_batch(
            x,
            images,
            idx,
            self.settings.seed & 0xFFFFFFFFFFFFFFFF,
            int(epoch),
            float(a.rotation),
            float(a.translation),
            float(a.scale),
            float(a.shear),
            float(a.elastic_alpha),
            float(a.elastic_sigma),
        )
        return x

    # -- introspection and shutdown ----------------------------------------------------------------

    def stats(self) -> dict:
        with self._cond:
            ready = sum(len(st.ready) for st in self._streams.values())
            streams = len(self._streams)
        capacity = streams * self.settings.buffer_batches
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
            "transport": dict(self.transport),
        }

    def _closed_message(self) -> ServerClosed:
        p = self.partition
        if self.ending:  # this process ends (an eviction): a stream recovers elsewhere
            hint = "a stream recovers on another DATA worker or serves the partition itself"
            return ServerClosed(f"the DataServer of partition {p} is ending", hint, ending=True)
        hint = "the DataService was closed; create a new one"
        return ServerClosed(f"the DataServer of partition {p} was shut down", hint)

    def close(self, ending: bool = False) -> None:
        """Stop serving; ``ending``: because this process ends (not the service's close)."""
        with self._cond:
            self.ending = self.ending or ending
            self._closed = True
            for st in self._streams.values():
                st.cond.notify_all()
            self._streams.clear()
            self._cond.notify_all()
        self.cache.close()
        _live.discard(self)
