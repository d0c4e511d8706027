"""The client side: a :class:`BatchStream` is one replica's share of one epoch.

The stream keeps ``prefetch`` ``next_batch`` requests in flight (peer-to-peer actor calls) and
hands out ``(x, y)``. It records which batch numbers of each partition it delivered; whenever a
partition changes server (its worker died or froze, the stream expired, the data workers came
back) the new server is opened with those numbers and produces only the others, so every image
of the share is delivered **exactly once**, and identically (the augmentation is
deterministic).

A server that stops answering is noticed within seconds, not after ``call-timeout``: a
request that waits longer than ``adam.serving.probe-after`` sends the server a ``ping``, and a
server that does not answer it within ``probe-timeout`` is lost (a frozen process keeps its
sockets open but answers nothing). The stream then asks the service for a replacement on a live
DATA worker and, with none, serves the partition itself while a thread of its own starts a
replacement as soon as a DATA worker joins (the replica trains on meanwhile) and the stream moves
there once it runs; every ``return-interval`` seconds it also looks whether the lost server's
own worker answers again (a frozen one thawed) and moves back to it. A stream opened after the
server's worker left the cluster goes straight to recovery, without a probe.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ... import config
from ..augment import as_model_input
from ._layout import batch_plan
from ._messages import (
    Batch,
    End,
    Message,
    ServerClosed,
    ServerLost,
    ServingError,
    StreamExpired,
)
from ._plane_source import PlaneSource, check_mode, open_plane
from ._search import ReplacementSearch
from ._sources import ActorSource, LocalSource, Remote, Timing
from ._types import ServerRef, Servers

logger = logging.getLogger(__name__)

__all__ = ["BatchStream"]

Source = ActorSource | PlaneSource | LocalSource


@dataclass(slots=True)
class _Request:
    p: int
    source: Source
    call: Future


class BatchStream:
    """One replica's share of one epoch; iterate for ``(x, y)`` batches.

    Keeps ``prefetch`` requests in flight (``adam.serving.prefetch``). ``len(stream)`` is the
    number of batches, ``stream.images`` the images in the share. ``resume`` and ``only``
    restrict it to part of the share (:meth:`DataService.stream`): the batches left out are
    never served, as if received already. Stop early with :meth:`close`
    (it releases the servers' state for this stream; other streams never wait for it).
    :meth:`stats` reports what was served, how long the consumer waited, and the recoveries.
    """

    def __init__(
        self,
        service: Servers,
        replica: int,
        replicas: int,
        epoch: int,
        batch_size: int,
        *,
        prefetch: int | None = None,
        return_index: bool = False,
        return_key: bool = False,
        resume: dict[tuple[int, int], int] | None = None,
        only: dict[tuple[int, int], tuple[int, int]] | None = None,
    ):
        self.service, self.replica, self.replicas, self.epoch = service, replica, replicas, epoch
        self.batch_size = batch_size
        self.prefetch = max(1, int(config.get("serving.prefetch", prefetch)))
        self.return_index = return_index
        self.return_key = return_key
        self.sid = f"{service.name}-e{epoch}-r{replica}of{replicas}-{uuid.uuid4().hex[:8]}"
        lay = service.layout
        self._counts, self._schedule = batch_plan(
            lay, replica, replicas, epoch, batch_size, service.seed
        )
        self.images = sum(lay.share_size(p, replica, replicas) for p in range(lay.partitions))
        self._timing = Timing.from_config()
        self._remote = None if service.local else Remote()
        self._plane_mode = check_mode(str(config.get("serving.data-plane")))
        self._pos = 0
        self._opened = 0
        self._pending: deque[_Request] = deque()
        self._received: list[set[int]] = [set() for _ in range(lay.partitions)]
        self._slices: dict[tuple[int, int], tuple[int, int]] = {}
        if resume is not None or only is not None:
            self._restrict(resume or {}, only)
        self._sources: dict[int, Source] = {}
        # replacements looked for in the background for partitions served here
        self._search = ReplacementSearch(service, self.sid, min(0.5, self._timing.return_interval))
        self._closed = False
        self.wait_seconds = self.max_wait_seconds = 0.0
        self.images_delivered = self.batches_delivered = self.local_batches = 0
        self.recoveries = self.unanswered = self.call_timeouts = self.returns = 0
        # batches delivered, by path; plane_shared: of the plane's, those named in shared memory
        self.transport = {"plane": 0, "dask": 0, "local": 0, "plane_shared": 0}
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._open_sources()

    def batch_images(self, p: int, k: int) -> int:
        """Images in batch ``k`` of partition ``p`` of this share."""
        size = self.service.layout.share_size(p, self.replica, self.replicas)
        return max(0, min(self.batch_size, size - k * self.batch_size))

    def _restrict(
        self,
        resume: dict[tuple[int, int], int],
        only: dict[tuple[int, int], tuple[int, int]] | None,
    ) -> None:
        """Serve part of the share: batches left out count as received (never asked for)."""
        for p, count in enumerate(self._counts):
            for k in range(count):
                n = self.batch_images(p, k)
                if only is not None:
                    a, b = only.get((p, k), (0, 0))
                else:
                    a, b = resume.get((p, k), 0), n
                a, b = max(0, int(a)), min(n, int(b))
                if a >= b:
                    self._received[p].add(k)
                elif (a, b) != (0, n):
                    self._slices[(p, k)] = (a, b)
        skip = [len(r) for r in self._received]
        schedule = []
        for p in reversed(self._schedule):  # the last requests of each partition go
            if skip[p]:
                skip[p] -= 1
            else:
                schedule.append(p)
        self._schedule = schedule[::-1]
        self.images = sum(
            self.batch_images(p, k)
            for p, count in enumerate(self._counts)
            for k in range(count)
            if k not in self._received[p]
        ) - sum(a + self.batch_images(p, k) - b for (p, k), (a, b) in self._slices.items())

    # -- sources ------------------------------------------------------------------------------------

    def _next_sid(self, p: int) -> str:
        """A new stream id per opening: late answers for an older one can never be taken
        for answers to this one."""
        self._opened += 1
        return f"{self.sid}-p{p}-o{self._opened}"

    def _open_args(self, p: int) -> tuple:
        done = sorted(self._received[p])
        return (self.epoch, self.replica, self.replicas, self.batch_size, done)

    def _open_sources(self) -> None:
        parts = [p for p, c in enumerate(self._counts) if c > 0]
        if self.service.local:
            for p in parts:
                self._sources[p] = self._serve_locally(p, None)
            return
        # Every partition is opened, even on a worker whose scheduler heartbeats look late: on a
        # loaded machine they arrive seconds late from a live worker (or the scheduler stamps
        # them late), so silence alone loses nothing; an open that waits is decided by a ping.
        refs = {p: self.service.server(p) for p in parts}
        # a server whose worker left the cluster (evicted, removed) is not opened and probed
        members = self.service.live_data_workers(math.inf)
        opening = [
            (p, ref, *self._start_open(p, ref))
            if members is None or ref.address in members
            else (p, ref, ServerLost(f"its worker {ref.address} left the cluster", "error"), None)
            for p, ref in refs.items()
        ]
        for p, ref, src, call in opening:  # collect the answers; a frozen server fails its probe
            out = self._finish_open(src, call)
            self._sources[p] = self._recover(p, out, ref) if isinstance(out, ServerLost) else out

    def _remote_calls(self) -> Remote:
        assert self._remote is not None, "a local service has no remote servers"
        return self._remote

    def _start_open(
        self, p: int, ref: ServerRef
    ) -> tuple[ActorSource | PlaneSource | ServerLost, Future | None]:
        """Send partition ``p``'s open to ``ref``: over its image plane when it can be
        reached, else as an actor call; the answer is read by :meth:`_finish_open`."""
        sid = self._next_sid(p)
        remote = self._remote_calls()
        if self._plane_mode != "dask":
            plane = open_plane(ref, sid, remote, self._timing, self._plane_mode)
            if isinstance(plane, ServerLost):
                return plane, None
            if plane is not None:
                return plane, plane.open(self._open_args(p), self.prefetch)
        src = ActorSource(ref, sid, remote, self._timing)
        return src, remote.call(ref.actor, "open", sid, *self._open_args(p))

    @staticmethod
    def _finish_open(
        src: ActorSource | PlaneSource | ServerLost, call: Future | None
    ) -> ActorSource | PlaneSource | ServerLost:
        if isinstance(src, ServerLost):
            return src
        assert call is not None
        out = src.wait(call)
        if isinstance(out, ServerLost):
            if isinstance(src, PlaneSource):
                src.close()
            return out
        return src

    def _connect(self, p: int, ref: ServerRef) -> ActorSource | PlaneSource | ServerLost:
        return self._finish_open(*self._start_open(p, ref))

    def _serve_locally(self, p: int, lost: ServerRef | None) -> LocalSource:
        sid = self._next_sid(p)
        server = self.service.local_server(p)
        server.open_stream(sid, *self._open_args(p))
        return LocalSource(server, sid, self._timing, lost)

    def _recover(self, p: int, lost: ServerLost, failed: ServerRef | None) -> Source:
        """A new source for partition ``p`` after its server was lost."""
        self.recoveries += 1
        self.unanswered += lost.cause == "unanswered"
        self.call_timeouts += lost.cause == "timeout"
        logger.warning(
            "stream %s: the DataServer of partition %d is lost (%s); recovering with %d "
            "batches already received",
            self.sid,
            p,
            lost.reason,
            len(self._received[p]),
        )
        if self.service.local or failed is None:
            return self._serve_locally(p, failed)
        for _ in range(2):
            ref = self.service.replacement(p, failed)
            if ref is None:
                break
            src = self._connect(p, ref)
            if not isinstance(src, ServerLost):
                return src
            failed = ref
        logger.warning(
            "stream %s: no DATA worker can serve partition %d; serving it here", self.sid, p
        )
        here = self._serve_locally(p, failed)
        self._search.start(p, failed)
        return here

    def _switch(self, p: int, new: Source, reissue: int) -> None:
        """Make ``new`` partition ``p``'s source: requests to the old one are dropped and
        asked again of the new one (``reissue`` more for requests already taken out)."""
        dropped = [r for r in self._pending if r.p == p]
        self._pending = deque(r for r in self._pending if r.p != p)
        for r in dropped:
            r.call.cancel()
        old = self._sources[p]
        if old is not new:
            old.close()
        self._sources[p] = new
        for _ in range(reissue + len(dropped)):
            self._issue(p)

    def _check_returns(self) -> None:
        """Partitions served here move back to a DATA worker: to the replacement the
        background search started, once it runs, or (looked for every ``return-interval``
        seconds) to their DataServer when its worker answers again."""
        now = time.monotonic()
        for p, src in list(self._sources.items()):
            if not (isinstance(src, LocalSource) and src.lost is not None):
                continue
            back: Source | ServerLost | None = None
            found = self._search.found(p)
            if found is not None:
                try:
                    ref = found.result()
                except Exception as exc:
                    logger.warning("stream %s: partition %d: no replacement: %s", self.sid, p, exc)
                    ref = None
                back = None if ref is None else self._connect(p, ref)
            if not self._usable(back) and now >= src.next_check:
                src.next_check = now + self._timing.return_interval
                live = self.service.live_data_workers()
                ref = self.service.server(p)
                if live and ref.address in live:
                    back = self._connect(p, ref)
                if not self._usable(back):
                    self._search.start(p, ref)
            if self._usable(back):
                assert back is not None and not isinstance(back, ServerLost)
                self._search.forget(p)
                logger.warning(
                    "stream %s: partition %d is served by a DATA worker again", self.sid, p
                )
                self.returns += 1
                self._switch(p, back, 0)

    @staticmethod
    def _usable(src: Source | ServerLost | None) -> bool:
        return src is not None and not isinstance(src, ServerLost)

    # -- iteration ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._schedule)

    def __iter__(self) -> Iterator:
        return self

    def _fill(self) -> None:
        while len(self._pending) < self.prefetch and self._pos < len(self._schedule):
            self._pos += 1
            self._issue(self._schedule[self._pos - 1])

    def _issue(self, p: int) -> None:
        src = self._sources[p]
        self._pending.append(_Request(p, src, src.request()))

    def __next__(self) -> tuple:
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        if self._t_first is None:
            self._t_first = t0
        try:
            got = self._next_batch()
        finally:
            waited = time.perf_counter() - t0
            self.wait_seconds += waited
            self.max_wait_seconds = max(self.max_wait_seconds, waited)
        if got is None:
            self._finish()
            raise StopIteration
        return self._deliver(*got)

    def _next_batch(self) -> tuple[_Request, Batch] | None:
        self._check_returns()
        self._fill()
        while self._pending:
            req = self._pending.popleft()
            batch = self._take(req, req.source.wait(req.call))
            if batch is not None:
                return req, batch
        return None

    def _take(self, req: _Request, msg: Message) -> Batch | None:
        """A new batch, or ``None`` after acting on any other answer."""
        p = req.p
        match msg:
            case Batch() if msg.k in self._received[p]:
                logger.warning("stream %s: batch %d of partition %d came twice", self.sid, msg.k, p)
                self._issue(p)
            case Batch():
                return msg
            case ServerClosed(ending=True):  # its worker is ending (evicted): recover
                self._lost(p, ServerLost(msg.message, "error"))
            case ServingError() | ServerClosed():
                self.close()
                raise msg.exception()
            case StreamExpired():  # the server dropped the stream (idle): open it again
                logger.warning("stream %s: partition %d dropped the stream; reopening", self.sid, p)
                self._switch(p, self._reopen(p, req.source), 1)
            case End():
                self._lost(p, ServerLost("the server ran out of batches early", "error"))
            case ServerLost():
                self._lost(p, msg)
        return None

    def _reopen(self, p: int, src: Source) -> Source:
        if isinstance(src, LocalSource):  # the same server, a new stream id
            src.sid = self._next_sid(p)
            src.server.open_stream(src.sid, *self._open_args(p))
            return src
        new = self._connect(p, src.ref)
        return self._recover(p, new, src.ref) if isinstance(new, ServerLost) else new

    def _lost(self, p: int, lost: ServerLost) -> None:
        src = self._sources[p]
        failed = src.lost if isinstance(src, LocalSource) else src.ref
        self._switch(p, self._recover(p, lost, failed), 1)

    def _deliver(self, req: _Request, batch: Batch) -> tuple:
        self._received[req.p].add(batch.k)
        self.batches_delivered += 1
        self.images_delivered += len(batch)
        self.local_batches += isinstance(req.source, LocalSource)
        how = (
            "local"
            if isinstance(req.source, LocalSource)
            else "plane"
            if isinstance(req.source, PlaneSource)
            else "dask"
        )
        self.transport[how] += 1
        if isinstance(req.source, PlaneSource) and req.source.last_shared:
            self.transport["plane_shared"] += 1
        self._fill()
        self._t_last = time.perf_counter()
        x = batch.x if batch.x.dtype == np.float32 else as_model_input(batch.x)
        y, idx = batch.y, batch.idx
        cut = self._slices.get((req.p, batch.k))
        if cut is not None:
            x, y, idx = x[cut[0] : cut[1]], y[cut[0] : cut[1]], idx[cut[0] : cut[1]]
        if self.return_key:
            return x, y, (req.p, batch.k)
        if self.return_index:
            return x, y, idx
        return x, y

    def _finish(self) -> None:
        if not self._closed:
            self._closed = True
            for r in self._pending:
                r.call.cancel()
            self._pending.clear()
            for src in self._sources.values():
                src.close()
            self._search.close()

    def close(self) -> None:
        """Stop early: release this stream's state on every server (does not wait)."""
        self._finish()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:
            pass

    def stats(self) -> dict:
        """What was served and how it went.

        images, batches (delivered), share_images, share_batches, wait_seconds (the consumer
        blocked in ``next``), max_wait_seconds (the longest such wait), elapsed_seconds (first
        ``next`` to the last batch), stall_fraction (their ratio), recoveries (servers lost),
        unanswered (of those, found frozen by a probe), call_timeouts (of those, lost after
        ``call-timeout``), local_batches (served in this process), returns (partitions moved
        back to a DATA worker), transport (batches delivered by path: ``plane`` the image
        plane, ``dask`` actor calls, ``local`` served in this process; ``plane_shared``: of the
        plane's, those that came through a shared segment on this machine).
        """
        elapsed = 0.0
        if self._t_first is not None:
            elapsed = (self._t_last or time.perf_counter()) - self._t_first
        return {
            "images": self.images_delivered,
            "batches": self.batches_delivered,
            "share_images": self.images,
            "share_batches": len(self),
            "wait_seconds": self.wait_seconds,
            "max_wait_seconds": self.max_wait_seconds,
            "elapsed_seconds": elapsed,
            "stall_fraction": self.wait_seconds / elapsed if elapsed > 0 else 0.0,
            "recoveries": self.recoveries,
            "unanswered": self.unanswered,
            "call_timeouts": self.call_timeouts,
            "local_batches": self.local_batches,
            "returns": self.returns,
            "transport": dict(self.transport),
        }
