"""The data planes' listeners (the parameter server's, :mod:`adam_dask.ps.plane.server`, and
the images', :mod:`adam_dask.data.serving._plane`): one per worker process and plane.

* a Unix socket in the abstract namespace (the same machine and network namespace: peers hand
  over ``memfd`` buffers with ``SCM_RIGHTS``);
* TCP on the worker's host, TLS with the worker's certificate on a ``tls://`` cluster
  (:mod:`adam_dask.net.tls`).

Each connection is served by a thread of its own, which first performs the TLS handshake and
checks the peer's token: the token reaches a peer only through the worker's actor (Dask's comm,
TLS on a TLS cluster), so a plane admits no one Dask would not.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from .framing import recv_msg
from .tls import listen_context

logger = logging.getLogger(__name__)

__all__ = ["Listeners"]


class Listeners:
    """The listeners of one plane next to ``worker``; each accepted connection is handed to
    ``serve(sock, unix)`` in a new thread named ``name``."""

    def __init__(self, worker: Any, prefix: str, name: str, serve: Callable[[Any, bool], None]):
        from distributed.comm.addressing import get_address_host, parse_address

        self.name, self.serve = name, serve
        self.unix_name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        self.token = secrets.token_hex(16)
        self.tls = listen_context(worker)  # an ssl.SSLContext on a TLS cluster
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind("\0" + self.unix_name)
        self._unix.listen(64)
        self.tcp: tuple[str, int] | None = None
        self._tcp: socket.socket | None = None
        if parse_address(worker.address)[0] in ("tcp", "tls"):
            host = get_address_host(worker.address)
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._tcp = socket.socket(fam, socket.SOCK_STREAM)
            self._tcp.bind((host, 0))
            self._tcp.listen(64)
            self.tcp = (host, self._tcp.getsockname()[1])
        for sock, unix in ((self._unix, True), (self._tcp, False)):
            if sock is not None:
                threading.Thread(
                    target=self._accept, args=(sock, unix), name=f"{name}-accept", daemon=True
                ).start()
        logger.debug("%s of %s: unix %s, tcp %s", name, worker.address, self.unix_name, self.tcp)

    def endpoint(self) -> dict:
        """What a peer needs to connect (the token included: hand it out over Dask only)."""
        return {
            "unix": self.unix_name,
            "tcp": list(self.tcp) if self.tcp else None,
            "tls": self.tls is not None,
            "token": self.token,
        }

    def admit(self, sock: Any, unix: bool) -> Any:
        """In the connection's thread: the TLS handshake (TCP on a TLS cluster), then the
        peer's hello with this plane's token; returns the socket to serve, or raises
        :class:`ConnectionError`."""
        if not unix and self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True)
        hello = recv_msg(sock)
        if hello.get("op") != "hello" or not secrets.compare_digest(
            str(hello.get("token", "")), self.token
        ):
            raise ConnectionError(f"a {self.name} connection without this worker's token")
        return sock

    def _accept(self, sock: socket.socket, unix: bool) -> None:
        while True:  # as long as the process: what the plane serves comes and goes
            try:
                conn, _ = sock.accept()
            except OSError:  # pragma: no cover - the listener was closed
                return
            if not unix:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self.serve, args=(conn, unix), name=f"{self.name}-conn", daemon=True
            ).start()
