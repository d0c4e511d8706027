"""The pusher's side of the data plane: a request's part for one node goes from the calling
thread straight to a socket, with no hop to an event loop and no Dask actor call.

* Same machine (a Unix socket in the same network namespace): the values live in a
  :class:`Segment` (a ``memfd``) handed to the node once (``SCM_RIGHTS``); a push is a header
  naming segment and offsets (no copy of the values at all), a pull names the segment the node
  writes the values into.
* Other machines (TCP): the header, then the values straight from their buffer (``sendall``:
  the kernel's copy only); a pull's values are read straight into their place.

:class:`PlaneCalls` writes a request's part (:meth:`PlaneCalls.send`) and reads the answer
(:meth:`PlaneCalls.receive`); the client (:mod:`adam_dask.ps.client`) routes, waits and
retries. A call that fails or times out closes its channel and *poisons* the segments it used
(a frozen node may still read them after it wakes: they are never written again).

``adam.ps.data-plane``: ``auto`` (shared memory on the same machine, TCP otherwise), ``tcp``
(never shared memory), ``dask`` (every call a Dask actor call).
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import ConfigError, ShardUnavailable, UpdateRejected
from ...net.framing import recv_exact_into, recv_msg, send_msg
from ..protocol.node_requests import OuterRequest, PushRequest, node_request
from ..protocol.replies import NodeReply, PullReply, PushReply, reply_from_wire
from ..protocol.request import Request, part_of, write_pulled

logger = logging.getLogger(__name__)

__all__ = ["Channel", "Channels", "PlaneCalls", "Pool", "Segment"]

_RETRY_DOWN = 5.0  # seconds before a node that refused a connection is tried again
_ERRORS = {"UpdateRejected": UpdateRejected, "ShardUnavailable": ShardUnavailable}


class Segment:
    """A float32 buffer of the pool: a ``memfd`` mapping (shareable with nodes on this machine)
    or plain memory. ``refs``: the caller's and the held pushes'; ``poisoned``: a node may
    still read it, so it is never written again."""

    __slots__ = ("__weakref__", "_closer", "array", "fd", "id", "poisoned", "pool", "refs")

    def __init__(self, pool: Pool, sid: int, floats: int, shareable: bool = True):
        self.pool, self.id, self.refs, self.poisoned = pool, sid, 0, False
        self.fd: int | None = None
        self._closer: weakref.finalize | None = None
        if shareable and hasattr(os, "memfd_create"):
            self.fd = os.memfd_create(f"adam-ps-{os.getpid()}-{sid}", os.MFD_CLOEXEC)
            # closed with the segment if nothing closed it before (a handle copied into a task
            # and dropped with it), or the process would keep the memory
            self._closer = weakref.finalize(self, os.close, self.fd)
            os.ftruncate(self.fd, max(floats * 4, 1))
            self.array = np.frombuffer(mmap.mmap(self.fd, max(floats * 4, 1)), np.float32)
            self.array = self.array[:floats]
        else:  # not Linux (TCP only), or taken from a closed pool
            self.array = np.empty(floats, np.float32)

    def release(self) -> None:
        self.pool.release(self)

    def close_fd(self) -> None:
        """Close the descriptor: it is shared with no node again (those that mapped it keep
        their mapping; so does :attr:`array`)."""
        if self._closer is not None:
            self._closer()
            self._closer = None
        self.fd = None


class Pool:
    """Segments of one server's size, reused once nothing refers to them. :meth:`close` (the
    handle's) closes every segment's descriptor; a segment's memory goes once no array of it is
    referenced here and no node maps it."""

    def __init__(self, floats: int):
        self.floats = int(floats)
        self._free: list[Segment] = []
        self._by_array: dict[int, Segment] = {}
        self._ids = 0
        self._lock = threading.Lock()
        self.closed = False

    def take(self) -> Segment:
        with self._lock:
            seg = self._free.pop() if self._free else None
            if seg is None:
                self._ids += 1
                seg = Segment(self, self._ids, self.floats, shareable=not self.closed)
                if not self.closed:
                    self._by_array[id(seg.array)] = seg
            seg.refs = 1
            return seg

    def close(self) -> None:
        """Close every segment's descriptor (arrays still referenced stay readable: the mapping
        holds the memory); a segment taken after is plain memory, shared with no node."""
        with self._lock:
            self.closed = True
            for seg in self._by_array.values():
                seg.close_fd()
            self._by_array.clear()
            self._free.clear()

    def of(self, array: np.ndarray) -> Segment | None:
        """The segment whose array ``array`` is (not a view of it)."""
        seg = self._by_array.get(id(array))
        return seg if seg is not None and seg.array is array else None

    def hold(self, seg: Segment) -> None:
        with self._lock:
            seg.refs += 1

    def release(self, seg: Segment) -> None:
        with self._lock:
            seg.refs -= 1
            if seg.refs == 0 and not seg.poisoned and not self.closed:
                self._free.append(seg)
            elif seg.refs == 0:
                self._by_array.pop(id(seg.array), None)
                seg.close_fd()  # nodes that mapped it keep their mapping

    def poison(self, seg: Segment) -> None:
        with self._lock:
            seg.poisoned = True


class Channel:
    """A connection to one node's data plane."""

    def __init__(self, sock: socket.socket, unix: bool, server_id: str):
        self.sock, self.unix, self.server_id = sock, unix, server_id
        self.shared: set[int] = set()  # segment ids the node has mapped
        self.pull_seg: Segment | None = None
        self._poller = select.poll()  # not select(): a busy process has descriptors past 1024
        self._poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)

    def readable(self, seconds: float) -> bool:
        """Whether an answer has started to arrive within ``seconds``."""
        pending = getattr(self.sock, "pending", None)  # TLS: bytes already decrypted
        if pending is not None and pending():
            return True
        return bool(self._poller.poll(max(seconds, 0.0) * 1000))

    def share(self, seg: Segment) -> None:
        if seg.id in self.shared:
            return
        if seg.fd is None:  # pragma: no cover - no memfd: the node is reached over TCP
            raise ConnectionError("this segment cannot be shared")
        send_msg(self.sock, {"op": "segment", "id": seg.id, "nbytes": seg.array.nbytes})
        socket.send_fds(self.sock, [b"s"], [seg.fd])
        self.shared.add(seg.id)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass


class Channels:
    """The data-plane connections of one handle, by (node address, actor key)."""

    def __init__(
        self,
        server_id: str,
        floats: int,
        mode: str,
        timeout: float,
        tls: Callable[[], Any] | None = None,
    ):
        self.tls = tls  # the SSL context a connection to a TLS node presents (Dask's own)
        if mode not in ("auto", "tcp"):
            raise ConfigError(f"adam.ps.data-plane is {mode!r}", "use auto, tcp or dask")
        self.server_id, self.mode, self.timeout = server_id, mode, float(timeout)
        self.pool = Pool(floats)
        self._open: dict[tuple[str, str], Channel] = {}
        self._down: dict[tuple[str, str], float] = {}
        self._endpoints: dict[tuple[str, str], dict] = {}
        self.counts = {"pushes": 0, "pulls": 0, "to_dask": 0, "failed_calls": 0}

    def get(self, addr: str, key: str, endpoint: Callable[[], dict]) -> Channel | None:
        k = (addr, key)
        ch = self._open.get(k)
        if ch is not None:
            return ch
        if time.monotonic() < self._down.get(k, 0.0):
            return None
        try:
            ep = self._endpoints.get(k) or endpoint()
            self._endpoints[k] = ep
            ch = self._connect(ep)
        except Exception as exc:
            logger.debug("data plane to %s unavailable (%r): the Dask path instead", addr, exc)
            self._down[k] = time.monotonic() + _RETRY_DOWN
            return None
        self._open[k] = ch
        return ch

    def _connect(self, ep: dict) -> Channel:
        if ep.get("server_id") != self.server_id:
            raise ConnectionError("the node serves another server")
        ch = None
        if self.mode == "auto" and ep.get("unix"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                s.connect("\0" + ep["unix"])
                ch = Channel(s, True, self.server_id)
            except OSError:  # another machine or network namespace
                s.close()
        if ch is None:
            if not ep.get("tcp"):
                raise ConnectionError("the node has no TCP data plane")
            host, port = ep["tcp"]
            s = socket.create_connection((host, int(port)), timeout=self.timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ep.get("tls"):
                ctx = self.tls() if self.tls is not None else None
                if ctx is None:
                    s.close()
                    raise ConnectionError("a TLS node, and no TLS credentials here")
                s = ctx.wrap_socket(s, server_hostname=host)
            ch = Channel(s, False, self.server_id)
        try:
            send_msg(ch.sock, {"op": "hello", "token": ep.get("token", "")})
        except OSError:
            ch.close()
            raise
        return ch

    def knows(self, addr: str, key: str) -> bool:
        return (addr, key) in self._endpoints

    def remember(self, addr: str, key: str, endpoint: dict) -> None:
        self._endpoints[(addr, key)] = endpoint

    def drop(self, addr: str, key: str) -> None:
        """Forget the node at ``addr`` (its connection and endpoint)."""
        ch = self._open.pop((addr, key), None)
        if ch is not None:
            ch.close()
        self._endpoints.pop((addr, key), None)
        self._down.pop((addr, key), None)

    def fail(self, addr: str, key: str, ch: Channel, *segs: Segment | None) -> None:
        """``ch`` failed mid-call: close it; the segments it used are never written again."""
        self.counts["failed_calls"] += 1
        ch.close()
        self._open.pop((addr, key), None)
        for seg in (*segs, ch.pull_seg):
            if seg is not None:
                self.pool.poison(seg)
        if ch.pull_seg is not None:
            ch.pull_seg.release()
            ch.pull_seg = None

    def close(self) -> None:
        """Close every connection and the pool's segments (:meth:`Pool.close`)."""
        for ch in self._open.values():
            ch.close()
        self._open.clear()
        self.pool.close()


def rebuilt_error(reply: dict) -> Exception:
    cls = _ERRORS.get(reply["error"])
    if cls is None:
        return ConnectionError(f"{reply['error']}: {reply['message']}")
    return cls(reply["message"], reply.get("hint"), shard=reply.get("shard"))


class PlaneCalls:
    """A request's part for one node on its channel: :meth:`send` writes it, :meth:`receive`
    reads the answer (and a pull's values into their place)."""

    def __init__(self, channels: Channels, shards: list[tuple[int, int]]):
        self.channels = channels
        self.shards = shards

    def segment_of(self, req: Request) -> Segment | None:
        """The segment holding a push's values: the caller's own :meth:`Pool.take` buffer, or
        one the values are copied into once (at their offsets; a partition's span leaves the
        rest of the segment unread)."""
        if req.op != "push" or req.outer is not None:
            return None
        pool = self.channels.pool
        seg = pool.of(req.values) if req.base == 0 else None
        if seg is not None:
            return seg
        seg = pool.take()
        n = req.values.shape[0]
        np.copyto(seg.array[req.base : req.base + n], req.values)
        for s in req.sids:  # a shard the values cover in part: zeros around them
            a, b = self.shards[s]
            if a < req.base:
                seg.array[a : req.base] = 0
            if b > req.base + n:
                seg.array[req.base + n : b] = 0
        req.values, req.base = seg.array, 0
        req.args["own_segment"] = seg
        return seg

    def send(
        self, ch: Channel, req: Request, sids: tuple[int, ...], stamps: dict, seg: Segment | None
    ) -> Any:
        """Write the part of ``req`` for ``sids`` to ``ch`` (its
        :func:`~adam_dask.ps.protocol.node_requests.node_request`, then the values); returns
        what :meth:`receive` needs (the segment a node on this machine writes pulled values
        into)."""
        sl = tuple(int(s) for s in sids)
        target = None
        where: tuple[int | None, tuple[int, ...] | None] | None = None
        if req.op == "pull" or (req.op == "push" and req.pull):
            if ch.unix:
                target = self._pull_target(ch, req.args.get("out"), req.args.get("out_base", 0))
                where = (target.id, None)
            else:
                where = (None, tuple(self.shards[s][1] - self.shards[s][0] for s in sl))
        values_in = None
        if req.op == "push" and req.outer is None and ch.unix:
            assert seg is not None
            ch.share(seg)
            values_in = seg.id
        head = node_request(
            req, sl, stamps, ch.server_id, self.shards, segment=values_in, pull=where
        )
        payloads: list = []
        if isinstance(head, OuterRequest):
            o = req.outer
            assert o is not None
            acts = np.ascontiguousarray(o.activations, dtype=np.float32)
            errs = np.ascontiguousarray(o.errors, dtype=np.float32)
            payloads = [acts, errs]
        elif isinstance(head, PushRequest) and values_in is None:
            payloads = [p for p in (part_of(req, self.shards[s], s) for s in sl) if p is not None]
        if target is not None:
            ch.share(target)
        send_msg(ch.sock, head.to_wire(), *payloads)
        return target

    def receive(self, ch: Channel, req: Request, target: Segment | None) -> NodeReply:
        """The node's answer (its error raised as it is), pulled values in their place."""
        wire = recv_msg(ch.sock)
        if "error" in wire:
            raise rebuilt_error(wire)
        if req.op == "pull":
            pulled = PullReply.from_plane(wire)
            for s in pulled.per_shard:
                self._pulled(ch, req, s, target)
            return pulled
        reply = reply_from_wire(req.op, wire)
        if req.pull and isinstance(reply, PushReply):
            for s in reply.pulled or ():
                self._pulled(ch, req, s, target)
        return reply

    def _pull_target(self, ch: Channel, out: Any, base: int) -> Segment:
        """The segment a node on this machine writes pulled values into: ``out`` itself when
        it is a pool buffer (no copy on this side), else the channel's own."""
        pool = self.channels.pool
        seg = pool.of(out) if base == 0 else None
        if seg is None or seg.poisoned:
            if ch.pull_seg is None:
                ch.pull_seg = pool.take()
            seg = ch.pull_seg
        return seg

    def _pulled(self, ch: Channel, req: Request, sid: int, target: Segment | None) -> None:
        """Shard ``sid``'s pulled values into the request's ``out``: read from the socket, or
        copied from the ``target`` segment the node wrote them to unless that is ``out``."""
        out, base = req.args["out"], int(req.args.get("out_base", 0))
        a, b = self.shards[sid]
        inside = base <= a and b <= base + out.shape[0]
        if not ch.unix:
            if inside:
                recv_exact_into(ch.sock, out[a - base : b - base])
            else:  # a partition's span: the shard's values, then the part it pulls
                scratch = np.empty(b - a, np.float32)
                recv_exact_into(ch.sock, scratch)
                write_pulled(req, (a, b), scratch)
        elif target is not None and not (target.array is out and base == 0):
            write_pulled(req, (a, b), target.array[a:b])
