"""A replica's communicator thread (paper 3.2.2): its pushes and pulls run beside training.

:class:`Communicator` runs ``send(item)`` on one thread for each item :meth:`~Communicator.put`,
in order. At most one item waits behind the one being sent (``put`` blocks while one waits), so
a replica that outruns the parameter server slows down rather than piling up updates. The first
error ``send`` raises is kept (:attr:`~Communicator.error`) and handed to ``on_error`` (which
stops the training); the items put after it go to ``drop``, unsent. :meth:`~Communicator.close`
sends (or drops) what was put and ends the thread.

Each partition of a partitioned replica, :class:`~adam_dask.train._pipeline.PartitionRunner`,
exchanges through it (an item is a push group's buffer).

A whole-model replica's :class:`~adam_dask.train._exchange.AsyncExchange` runs on a
:class:`DueLoop` instead: ``send()`` on one thread whenever :meth:`~DueLoop.due` was called since
the last ``send`` began. The update is taken when it is sent, not when it fell due, so a push
due while one is in flight joins the next one (the paper's accumulate-then-push): at most one
exchange is in flight, the training threads never wait for the parameter server, and a busy
server sees fewer, larger pushes instead of holding replicas back.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Communicator", "DueLoop"]

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


class DueLoop:
    """Runs ``send()`` on a thread named ``name`` whenever :meth:`due` was called since the last
    ``send`` began (many calls while one runs: one more ``send``). The first error ``send``
    raises is kept (:attr:`error`), handed to ``on_error`` and ends the sending."""

    def __init__(
        self, send: Callable[[], None], *, name: str, on_error: Callable[[BaseException], None]
    ):
        self._send, self._on_error = send, on_error
        self._cv = threading.Condition()
        self._due = self._closing = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name=name, daemon=True
        )
        self._thread.start()

    def due(self) -> None:
        """A send is due; never blocks."""
        with self._cv:
            self._due = True
            self._cv.notify()

    def close(self) -> None:
        """Wait for the send in flight (a due one not yet begun is left to the caller) and end
        the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._due or self._closing):
                    self._cv.wait()
                if self._closing or self.error is not None:
                    return
                self._due = False
            try:
                self._send()
            except BaseException as exc:
                self.error = exc
                self._on_error(exc)
                return
