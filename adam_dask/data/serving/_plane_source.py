"""The reader's side of the images' data plane: a :class:`PlaneSource` is one partition of one
stream, read from the consumer's own thread on a socket of its own (no Dask actor call and no
event loop per batch; see :mod:`._plane` for the server and the protocol).

Requests are written as the stream issues them (``prefetch`` in flight) and their answers read
in order. On the same machine a batch's answer names a slot of the shared segment the server
handed over once; the reader makes the model's input from it (the uint8 -> float32 conversion
it makes for every batch anyway, or one copy of augmented float32) and frees the slot in its
next request. Across machines the batch's bytes follow the header and are read into the batch.

A server that stops answering is noticed as :class:`~._sources.ActorSource` notices it: a read
that waits ``probe-after`` seconds pings the DataServer actor (Dask's comm), and an unanswered
ping, or ``call-timeout`` without a batch, makes the answer :class:`~._messages.ServerLost`;
a closed connection (the worker died) makes it at once. The stream then recovers as for any
source, asking the next server for the batches it has not received.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import msgpack
import numpy as np

from ...errors import ConfigError
from ...net.framing import MAX_HEADER, send_msg
from ...net.tls import connect_context
from ..augment import as_model_input
from ._messages import (
    Batch,
    End,
    ServerClosed,
    ServerLost,
    ServingError,
    StreamExpired,
)
from ._sources import ActorSource, Remote, Timing
from ._types import ServerRef

logger = logging.getLogger(__name__)

__all__ = ["PLANE_MODES", "PlaneSource", "open_plane"]

PLANE_MODES = ("auto", "tcp", "dask")
_LEN = struct.Struct("<I")
# (worker address, actor key) -> endpoint: asked of a DataServer once per process
_endpoints: dict[tuple[str, str], dict] = {}


class _Lost(Exception):
    def __init__(self, lost: ServerLost):
        self.lost = lost


def check_mode(mode: str) -> str:
    if mode not in PLANE_MODES:
        raise ConfigError(
            f"adam.serving.data-plane is {mode!r}", f"use one of {', '.join(PLANE_MODES)}"
        )
    return mode


def open_plane(
    ref: ServerRef, sid: str, remote: Remote, timing: Timing, mode: str
) -> PlaneSource | ServerLost | None:
    """A connection to ``ref``'s image plane for stream ``sid``; ``None`` when the plane
    cannot reach it (a firewall between them): the Dask path then. ``ServerLost`` when
    the DataServer does not tell its endpoint (gone or frozen)."""
    key = (ref.address, str(getattr(ref.actor, "key", ref.generation)))
    ep = _endpoints.get(key)
    if ep is None:
        probe = ActorSource(ref, sid, remote, timing)
        got = probe.wait(remote.call(ref.actor, "plane"))
        if isinstance(got, ServerLost):
            return got
        ep = _endpoints[key] = dict(got)
    sock: socket.socket | None = None
    unix = False
    if mode == "auto" and ep.get("unix"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timing.probe_timeout)
        try:
            s.connect("\0" + ep["unix"])
            sock, unix = s, True
        except OSError:  # another machine or network namespace
            s.close()
    if sock is None and ep.get("tcp"):
        host, port = ep["tcp"]
        try:
            sock = socket.create_connection((host, int(port)), timeout=timing.probe_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ep.get("tls"):  # a TLS cluster: Dask's own certificates
                ctx = connect_context()
                if ctx is None:
                    raise ConnectionError("a TLS image plane, and no TLS credentials here")
                sock = ctx.wrap_socket(sock, server_hostname=host)
        except OSError as exc:
            logger.debug("image plane of %s unreachable (%r): the Dask path", ref.address, exc)
            _endpoints.pop(key, None)
            return None
    if sock is None:
        return None
    try:
        send_msg(sock, {"op": "hello", "token": ep["token"]})
    except OSError:
        sock.close()
        _endpoints.pop(key, None)
        return None
    sock.settimeout(timing.probe_after)
    return PlaneSource(ref, sid, sock, unix, str(ep["server"]), remote, timing)


class PlaneSource:
    """Stream ``sid`` of one partition on a DataServer, over its image plane."""

    def __init__(
        self,
        ref: ServerRef,
        sid: str,
        sock: socket.socket,
        unix: bool,
        server: str,
        remote: Remote,
        timing: Timing,
    ):
        self.ref, self.sid, self.sock, self.unix = ref, sid, sock, unix
        self.server, self.remote, self.timing = server, remote, timing
        self._shm: np.ndarray | None = None
        self._map: mmap.mmap | None = None
        self._free: list[int] = []
        self._expect: deque[tuple[Future, str]] = deque()  # requests, oldest first
        self._broken: ServerLost | None = None
        self.last_shared = False  # the last batch came in the shared segment (no bytes sent)

    # -- requests -------------------------------------------------------------------------------

    def open(self, args: tuple, prefetch: int) -> Future:
        """Send the stream's ``open`` (``args`` as :meth:`PartitionServer.open_stream`'s)."""
        epoch, replica, replicas, batch_size, done = args
        header = {
            "op": "open",
            "server": self.server,
            "sid": self.sid,
            "epoch": int(epoch),
            "replica": int(replica),
            "replicas": int(replicas),
            "batch_size": int(batch_size),
            "done": [int(k) for k in done],
            "prefetch": int(prefetch),
            "shm": self.unix,
        }
        return self._send(header)

    def request(self) -> Future:
        header = {"op": "next", "free": self._free}
        self._free = []
        return self._send(header)

    def _send(self, header: dict) -> Future:
        call: Future = Future()
        self._expect.append((call, header["op"]))
        if self._broken is None:
            try:
                send_msg(self.sock, header)
            except OSError as exc:  # a dead server: the answer's wait says so
                self._broken = ServerLost(f"{type(exc).__name__}: {exc}", "error")
        return call

    # -- answers --------------------------------------------------------------------------------

    def wait(self, call: Future) -> Any:
        """The answer to ``call`` (the oldest unanswered request): a message of
        :mod:`._messages`, the batch count for an ``open``, or :class:`ServerLost`."""
        while self._expect and self._expect[0][0] is not call:  # dropped requests: skip
            _, op = self._expect.popleft()
            if self._broken is None:
                try:
                    self._reply(time.monotonic(), op, discard=True)
                except _Lost as lost:
                    self._fail(lost.lost)
        op = self._expect.popleft()[1] if self._expect else "next"
        if self._broken is not None:
            return self._broken
        try:
            return self._reply(time.monotonic(), op)
        except _Lost as lost:
            self._fail(lost.lost)
            return lost.lost

    def _fail(self, lost: ServerLost) -> None:
        self._broken = lost
        self.close()

    def _reply(self, start: float, op: str, discard: bool = False) -> Any:
        h = self._header(start)
        kind = h.get("kind")
        if kind == "batch":
            return self._batch(h, start, discard)
        if kind == "opened":
            if "segment" in h:
                self._map_segment(int(h["segment"]), start)
            return int(h["n"])
        if kind == "end":
            return End()
        if kind == "error":
            return ServingError(str(h["message"]), h.get("hint"), h.get("url"))
        if kind == "closed":
            closed = ServerClosed(str(h["message"]), h.get("hint"), bool(h.get("ending")))
            if op != "open":  # a take: the stream decides (a worker ending is a lost server)
                return closed
            if closed.ending:  # an open on a server whose worker is ending: a lost server
                raise _Lost(ServerLost(closed.message, "error"))
            raise closed.exception()  # as the actor's open raises it
        if kind == "expired":
            return StreamExpired(str(h["message"]))
        if kind == "lost":
            raise _Lost(ServerLost(str(h.get("message")), "error"))
        raise _Lost(ServerLost(f"an image-plane answer of kind {kind!r}", "error"))

    def _batch(self, h: dict, start: float, discard: bool) -> Batch | None:
        shape, dtype = tuple(int(v) for v in h["shape"]), np.dtype(h["dtype"])
        y = np.frombuffer(h["y"], np.int64).copy()
        idx = np.frombuffer(h["idx"], np.int64).copy()
        if "slot" in h:
            self._free.append(int(h["slot"]))
            if discard or self._shm is None:
                return None
            self.last_shared = True
            a = int(h["offset"])
            n = int(np.prod(shape)) * dtype.itemsize
            view = self._shm[a : a + n].view(dtype).reshape(shape)
            # the one pass over the values on this side; the slot is free after it
            x = view.copy() if dtype == np.float32 else as_model_input(view)
        else:
            self.last_shared = False
            x = np.empty(shape, dtype)
            self._read(x.reshape(-1).view(np.uint8), start)
            if discard:
                return None
        return Batch(int(h["k"]), x, y, idx)

    def _map_segment(self, nbytes: int, start: float) -> None:
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
                break
            except TimeoutError:
                self._still_waiting(start)
            except OSError as exc:
                raise _Lost(ServerLost(f"{type(exc).__name__}: {exc}", "error")) from exc
        if len(fds) != 1:
            raise _Lost(ServerLost("an image-plane segment without its descriptor", "error"))
        try:
            self._map = mmap.mmap(fds[0], nbytes)
        finally:
            for fd in fds:
                os.close(fd)
        self._shm = np.frombuffer(self._map, np.uint8)

    def _header(self, start: float) -> dict:
        head = bytearray(_LEN.size)
        self._read(memoryview(head), start)
        (n,) = _LEN.unpack(head)
        if n > MAX_HEADER:
            raise _Lost(ServerLost(f"an image-plane header of {n} bytes", "error"))
        body = bytearray(n)
        self._read(memoryview(body), start)
        return msgpack.unpackb(bytes(body), raw=False, strict_map_key=False)

    def _read(self, view: Any, start: float) -> None:
        """Fill ``view``; probes the server while it is slow (keeps what arrived meanwhile)."""
        mv = memoryview(view).cast("B")
        got, n = 0, mv.nbytes
        while got < n:
            try:
                k = self.sock.recv_into(mv[got:], n - got)
            except TimeoutError:
                self._still_waiting(start)
                continue
            except OSError as exc:
                raise _Lost(ServerLost(f"{type(exc).__name__}: {exc}", "error")) from exc
            if k == 0:
                raise _Lost(ServerLost("the DataServer closed its image-plane connection", "error"))
            got += k

    def _still_waiting(self, start: float) -> None:
        """After ``probe-after`` without an answer: lost when the server does not answer a
        ping, or when ``call-timeout`` has passed."""
        t = self.timing
        if not ActorSource(self.ref, self.sid, self.remote, t).alive():
            raise _Lost(
                ServerLost(
                    f"its worker {self.ref.address} did not answer a ping within "
                    f"{t.probe_timeout} s (frozen?)",
                    "unanswered",
                )
            )
        if time.monotonic() - start > t.call_timeout:
            raise _Lost(
                ServerLost(
                    f"no answer within {t.call_timeout} s (adam.serving.call-timeout)", "timeout"
                )
            )

    def close(self) -> None:
        """End the stream here (the server closes it when the connection ends)."""
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass
        self._shm = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exists: unmapped when it goes
                pass
            self._map = None
