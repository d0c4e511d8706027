"""A replica's communicator thread (paper 3.2.2): its pushes and pulls run beside training.

:class:`Communicator` runs ``send(item)`` on one thread for each item :meth:`~Communicator.put`,
in order. At most one item waits behind the one being sent (``put`` blocks while one waits), so
a replica that outruns the parameter server slows down rather than piling up updates. The first
error ``send`` raises is kept (:attr:`~Communicator.error`) and handed to ``on_error`` (which
stops the training); the items put after it go to ``drop``, unsent. :meth:`~Communicator.close`
sends (or drops) what was put and ends the thread.

Each stage of a replica (:class:`~adam_dask.train._stage_exchange.StageExchange`, a whole model
or one partition of it) exchanges through it: an item is a push group's buffer.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Communicator"]

T = TypeVar("T")


class _End:
    """What :meth:`Communicator.close` puts: the thread ends on it."""


class Communicator(Generic[T]):
    """Runs ``send`` on the items put, one at a time, on a thread named ``name``."""

    def __init__(
        self,
        send: Callable[[T], None],
        *,
        name: str,
        on_error: Callable[[BaseException], None],
        drop: Callable[[T], None] | None = None,
    ):
        self._send, self._on_error, self._drop = send, on_error, drop
        self._queue: queue.Queue[T | _End] = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name=name, daemon=True
        )
        self._thread.start()

    def put(self, item: T) -> None:
        """Queue ``item`` to be sent; blocks while another one waits."""
        self._queue.put(item)

    def close(self) -> None:
        """Send (or, after an error, drop) the items put, then end the thread."""
        if self._thread.is_alive():
            self._queue.put(_End())
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _End):
                return
            if self.error is not None:
                if self._drop is not None:
                    self._drop(item)
                continue
            try:
                self._send(item)
            except BaseException as exc:
                self.error = exc
                self._on_error(exc)
