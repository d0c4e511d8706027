"""The DataServer actor: a :class:`~._partition.PartitionServer` on a DATA worker.

Every method is ``async``, so calls run on the worker's event loop and never queue behind the
worker's single actor thread; the work (reading, augmenting) runs in the core's own threads,
which release the GIL. ``next_batch`` waits on an event that the producers set, so a request
answers as soon as its batch is ready, and :meth:`DataServer.ping` answers at once whenever the
process runs: a stream uses it to tell a busy server from a frozen one.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from ._messages import Batch, Message
from ._partition import PartitionServer

logger = logging.getLogger(__name__)

__all__ = ["DataServer"]


class DataServer:
    """A Dask actor serving one partition; create it through
    :meth:`~adam_dask.data.serving.DataService.create`. Arguments are those of
    :class:`~._partition.PartitionServer`."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._endpoint: dict | None = None
        me = weakref.ref(self)

        def notify(sid: str) -> None:
            server = me()
            if server is not None:
                server._notify(sid)

        # the core's threads hold only a weak reference to the actor, so when Dask releases
        # the actor (its DataService closed, or a newer generation replaced it) the core stops
        self._core = PartitionServer(*args, notify=notify, **kwargs)
        weakref.finalize(self, self._core.close)

    def _notify(self, sid: str) -> None:  # from a producer thread
        # only a stream opened by an actor call waits on the event loop: one on the image
        # plane (open there, never here) takes its batches in its connection's thread, and a
        # wake-up of the loop per batch for it cost the worker's loop a run per batch made
        loop = self._loop
        if loop is not None and sid in self._events:
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
        """Open stream ``sid`` (see :meth:`PartitionServer.open_stream`); the batch count."""
        self._loop = asyncio.get_running_loop()
        self._events[sid] = asyncio.Event()
        return self._core.open_stream(sid, epoch, replica, replicas, batch_size, done or ())

    async def next_batch(self, sid: str) -> Message:
        """The next message of stream ``sid`` (waits for the producers when none is ready)."""
        while True:
            ev = self._events.get(sid)
            if ev is not None:
                ev.clear()
            item = self._core.try_take(sid)
            if item is not None:
                if isinstance(item, Batch):
                    self._core.count_transport("dask")
                return item
            if ev is None:  # not opened here: try_take answered StreamExpired; be safe anyway
                await asyncio.sleep(0)
            else:
                await ev.wait()

    async def close_stream(self, sid: str) -> bool:
        closed = self._core.close_stream(sid)
        ev = self._events.pop(sid, None)
        if ev is not None:  # a next_batch still waiting answers StreamExpired
            ev.set()
        return closed

    async def stats(self) -> dict:
        return self._core.stats()

    async def ready(self, timeout: float | None = None) -> bool:
        """Wait (off the event loop) until the partition and the kernels are loaded."""
        return await asyncio.to_thread(self._core.wait_ready, timeout)

    async def plane(self) -> dict:
        """This server's image-plane endpoint (addresses and token; the plane starts on first
        use): only over this call, Dask's comm, does a reader learn the token."""
        if self._endpoint is None:
            from distributed import get_worker

            from ._plane import image_plane

            self._endpoint = image_plane(get_worker()).register(self._core)
        return self._endpoint

    async def ping(self) -> int:
        """The partition number, at once: the liveness probe of a stream."""
        return self._core.partition

    async def shutdown(self) -> None:
        self._core.close()
