"""The socket sink of the capacity benchmarks (``capacity.py``, ``data_capacity.py``): a plain
thread-per-connection server, started in a worker's process, that moves a target's bytes and
does nothing else, so a step against it measures what the machine's transport alone allows.

:class:`SocketSink` holds what every sink does (the accept loop, a thread per connection, the
open connections, stopping); a benchmark's sink subclasses it with :meth:`SocketSink.serve`,
what one connection does. :func:`stop_sink` stops the sink a benchmark kept on a Dask worker.
"""

from __future__ import annotations

import socket
import threading
from typing import Any


class SocketSink:
    """A thread per connection accepted on ``listener`` (bound and listening), each running
    :meth:`serve`; the accept loop is a daemon thread named ``name``. ``nodelay``: set
    TCP_NODELAY on each connection (a TCP listener). A subclass sets what :meth:`serve` reads
    before calling this ``__init__``: the accept loop starts in it."""

    def __init__(self, listener: socket.socket, name: str, *, nodelay: bool = False):
        self.listener = listener
        self.listener.settimeout(0.5)
        self.nodelay = nodelay
        self.stopped = threading.Event()
        self.conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        """What one connection does, until its peer closes it (return) or it fails (OSError)."""
        raise NotImplementedError

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener closed: stopped
                return
            conn.settimeout(None)
            if self.nodelay:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except OSError:
            return
        finally:
            self.conns.discard(conn)
            conn.close()

    def stop(self) -> None:
        """Stop accepting, and shut the open connections down (their threads then end)."""
        self.stopped.set()
        self.listener.close()
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def stop_sink(dask_worker: Any, attr: str) -> None:
    """For ``client.run``: stop the sink kept on the worker as ``attr`` (if any) and drop it."""
    sink = getattr(dask_worker, attr, None)
    if sink is not None:
        sink.stop()
        setattr(dask_worker, attr, None)
