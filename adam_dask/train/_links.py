"""The sockets between the partitions of one replica: how two neighbours meet
(:func:`meet`, through a :class:`distributed.Variable` and a token) and how messages cross
(:class:`Link`: the data plane's framing, :mod:`adam_dask.net.framing`, a msgpack header
then the raw float32 bytes, each message in one ``sendmsg`` and read through a buffer).

Activations go forward and error terms back over these long-lived TCP sockets; the
partitions' runners (:mod:`._pipeline`) only send and receive whole messages. Tests connect
runners with socket pairs, without :func:`meet`.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..net.framing import recv_exact_into, recv_msg, send_msg

if TYPE_CHECKING:
    from .replica import Flag

__all__ = ["Link", "meet"]


class _Stream:
    """A socket's reading side as the data plane's framing (:mod:`adam_dask.net.framing`) reads
    it, in fewer system calls: ``recv_into`` serves small reads from one ``recv`` of whatever
    has arrived (a message's length, header and a small payload in one call); a read of at
    least half the buffer with nothing buffered goes straight into the caller's buffer. (The
    framing's ``send_msg`` sends a message in one ``sendmsg`` itself.)"""

    def __init__(self, sock: socket.socket, size: int = 1 << 18):
        self.sock = sock
        self._view = memoryview(bytearray(size))
        self._lo = self._hi = 0

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        n = nbytes or view.nbytes
        if self._lo == self._hi:
            if n >= self._view.nbytes // 2:
                return self.sock.recv_into(view, n)
            self._lo, self._hi = 0, self.sock.recv_into(self._view)
            if self._hi == 0:
                return 0
        k = min(n, self._hi - self._lo)
        view[:k] = self._view[self._lo : self._lo + k]
        self._lo += k
        return k


class Link:
    """A socket to a neighbour partition: whole messages sent under a lock (several threads
    send), each in one system call, read by one thread through a buffer; bytes counted."""

    def __init__(self, sock: socket.socket):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._stream = _Stream(sock)
        self.lock = threading.Lock()
        self.bytes_sent = 0

    def send(self, header: dict, payload: np.ndarray | None = None) -> None:
        with self.lock:
            if payload is None:
                send_msg(self.sock, header)
            else:
                send_msg(self.sock, header, payload)
                self.bytes_sent += payload.nbytes

    def recv(self, shape_of: Callable[[dict], tuple[int, ...] | None]) -> tuple[dict, Any]:
        header = recv_msg(self._stream)  # type: ignore[arg-type]
        shape = shape_of(header)
        if shape is None:
            return header, None
        buf = np.empty(shape, np.float32)
        recv_exact_into(self._stream, buf)  # type: ignore[arg-type]
        return header, buf

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def meet(
    partition: int,
    parts: int,
    address_name: Callable[[int], str],
    host: str,
    timeout: float,
    abort: Flag,
) -> tuple[Link | None, Link | None] | None:
    """Connect partition ``partition`` of ``parts`` to its neighbours: returns ``(up, down)``,
    each a :class:`Link` (None at the ends), or None when ``abort`` was set or they did not meet
    within ``timeout`` seconds. Each partition but the first listens on ``host`` and
    publishes ``{host, port, token}`` in the :class:`distributed.Variable` named
    ``address_name(partition)``; each but the last reads its successor's, connects, and
    presents the token (a connection without it is not the partition this attempt awaits)."""
    from distributed import Variable

    deadline = time.monotonic() + timeout
    listener = None
    token = secrets.token_hex(16)
    if partition > 0:
        listener = socket.create_server((host, 0))
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        Variable(address_name(partition)).set({"host": host, "port": port, "token": token})
    down = up = None
    try:
        if partition < parts - 1:
            var = Variable(address_name(partition + 1))
            while True:
                if abort.is_set() or time.monotonic() > deadline:
                    return None
                try:
                    addr = var.get(timeout=0.5)
                    break
                except TimeoutError:
                    continue
            sock = socket.create_connection((addr["host"], int(addr["port"])), timeout=10)
            sock.settimeout(None)
            down = Link(sock)
            down.send({"op": "hello", "token": addr["token"], "from": partition})
        if listener is not None:
            while True:
                if abort.is_set() or time.monotonic() > deadline:
                    return None
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                link = Link(conn)
                try:
                    hello, _ = link.recv(lambda h: None)
                except (OSError, ValueError):
                    link.close()
                    continue
                if hello.get("token") != token:  # not the partition this attempt awaits
                    link.close()
                    continue
                up = link
                break
        return up, down
    finally:
        if listener is not None:
            listener.close()
