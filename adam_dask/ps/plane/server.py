"""The node's side of the data plane: pushes and pulls straight from a socket to the shards.

One :class:`PlaneServer` per PS worker process serves every :class:`~adam_dask.ps.runtime.node.PSNode`
of the process (one per server id). It listens on

* a Unix socket in the abstract namespace (same machine, same network namespace): the pusher
  hands over ``memfd`` buffers once (``SCM_RIGHTS``) and each push or pull then names a buffer
  and an offset, so the values never cross a socket (the paper's 3.2.3: a pointer handed over
  locally, a copy remotely). The segments have no name in any file system: the kernel frees
  them when the last process mapping them exits, SIGKILL included, so nothing leaks;
* TCP on the worker's host: the values follow the header and are read straight into a buffer
  of the connection. On a ``tls://`` cluster these connections are TLS, with the certificates
  of Dask's own security settings (the worker's here, the pusher's own there).

A connection is served by one thread: it reads a push (the bytes land once, in the shared
segment or in the connection's buffer) and hands it to the node's protocol state
(:class:`~adam_dask.ps.protocol.node_state.NodeState`, unchanged: fenced, deduplicated, applied) in
this thread, under the state's lock, batched with the pushes other connections brought
meanwhile (:meth:`~adam_dask.ps.runtime.node_plane.NodePlane.push`); then it sends the node's answer. The
pusher checked the values (NaN/Inf) before sending; the node checks their lengths. A pull
copies the primaries' values under the same lock, between two batches of pushes, into the
pusher's segment (or the connection's buffer, then the socket): never a torn value. A primary's
forwards to its backups come the same way (``replicate``, :mod:`adam_dask.ps.plane.forward`).
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import socket
import threading
from dataclasses import replace
from typing import Any

import numpy as np

from ...errors import AdamError
from ...net.framing import recv_exact_into, recv_msg, send_msg
from ...net.listen import Listeners
from ..protocol.node_requests import (
    ConfirmedRequest,
    OuterRequest,
    PullRequest,
    PushRequest,
    request_from_wire,
)
from ..protocol.replies import ConfirmedReply, PullReply, PushReply
from .forward import payload_floats, snapshots_from

logger = logging.getLogger(__name__)

__all__ = ["PlaneServer", "plane_server"]

_lock = threading.Lock()
_server: PlaneServer | None = None


def plane_server(worker: Any) -> PlaneServer:
    """The process's data-plane server (started on first use)."""
    global _server
    with _lock:
        if _server is None:
            _server = PlaneServer(worker)
        return _server


def error_reply(exc: BaseException) -> dict:
    """An exception as a reply header (the pusher raises it again)."""
    if isinstance(exc, AdamError):
        shard = getattr(exc, "shard", None)
        return {
            "error": type(exc).__name__,
            "message": exc.message,
            "hint": exc.hint,
            "shard": shard,
        }
    return {"error": type(exc).__name__, "message": str(exc), "hint": None, "shard": None}


class PlaneServer:
    """The parameter server's plane in one PS worker process: its listeners
    (:class:`~adam_dask.net.listen.Listeners`) and the nodes it serves, by server id."""

    def __init__(self, worker: Any):
        self.nodes: dict[str, Any] = {}  # server id -> PSNode
        self.listeners = Listeners(
            worker, "adam-ps", "adam-plane", lambda sock, unix: _Connection(self, sock, unix).run()
        )

    def endpoint(self) -> dict:
        return self.listeners.endpoint()

    def register(self, server_id: str, node: Any) -> None:
        self.nodes[server_id] = node

    def unregister(self, server_id: str, node: Any) -> None:
        if self.nodes.get(server_id) is node:
            del self.nodes[server_id]


class _Connection:
    """One pusher's connection: its shared segments (Unix) or receive buffer (TCP)."""

    def __init__(self, server: PlaneServer, sock: socket.socket, unix: bool):
        self.server = server
        self.sock = sock
        self.unix = unix
        self.segments: dict[int, np.ndarray] = {}  # buffer id -> float32 view of the mapping
        self.buf = np.empty(0, np.float32)
        self.pull_buf = np.empty(0, np.float32)

    def run(self) -> None:
        try:
            self.sock = self.server.listeners.admit(self.sock, self.unix)
            while True:
                h = recv_msg(self.sock)
                op = h["op"]
                if op == "segment":
                    self._segment(h)
                    continue
                if op == "replicate":
                    send_msg(self.sock, self._replicate(h))
                    continue
                r = request_from_wire(h)
                if isinstance(r, PushRequest) and r.pull is not None:
                    self._push_pull(r, r.pull)
                elif isinstance(r, (PushRequest, OuterRequest)):
                    send_msg(self.sock, _wire(self._push(r)))
                elif isinstance(r, PullRequest):
                    self._pull(r)
                else:
                    send_msg(self.sock, self._confirmed(r))
        except (ConnectionError, OSError, ValueError) as exc:
            logger.debug("data-plane connection closed: %r", exc)
        except Exception as exc:  # a peer that broke the protocol: close, serve the others
            logger.warning("data-plane connection closed on a malformed message: %r", exc)
        finally:
            self.sock.close()
            if self.segments:  # unmapped when the last view goes (a view caught in a
                self.segments.clear()  # reference cycle would keep the pusher's memory)
                gc.collect()

    def _segment(self, h: dict) -> None:
        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        if len(fds) != 1:
            raise ConnectionError("a segment message without its file descriptor")
        try:
            mm = mmap.mmap(fds[0], int(h["nbytes"]))
        finally:
            for fd in fds:
                os.close(fd)
        self.segments[int(h["id"])] = np.frombuffer(mm, np.float32)

    def _buffer(self, n: int, pull: bool = False) -> np.ndarray:
        """The connection's receive buffer (or its send buffer, ``pull``), at least ``n``."""
        if pull:
            if self.pull_buf.shape[0] < n:
                self.pull_buf = np.empty(n, np.float32)
            return self.pull_buf[:n]
        if self.buf.shape[0] < n:
            self.buf = np.empty(n, np.float32)
        return self.buf[:n]

    def _node(self, server: str) -> Any:
        return self.server.nodes.get(server)

    def _push(self, r: PushRequest | OuterRequest) -> PushReply | dict:
        """A push's values (named in a shared segment, or read from the socket; the dense
        offload's activations and errors always follow the header, and its update is computed
        here), applied by the node in this thread. Its answer, or the node's error as it goes
        on the wire."""
        deltas: dict[int, np.ndarray | None] = {}
        if isinstance(r, OuterRequest):
            b, inp, out = r.batch, r.inp, r.out
            buf = self._buffer(b * (inp + out))
            recv_exact_into(self.sock, buf)
            acts = buf[: b * inp].reshape(b, inp)
            errs = buf[b * inp :].reshape(b, out)
        elif r.segment is not None:  # the values lie in a segment the pusher shared
            seg = self.segments[r.segment]
            for sid, start, n in r.parts:
                lo = start - r.offset
                deltas[sid] = None if n < 0 else seg[lo : lo + n]
        else:
            buf = self._buffer(sum(n for _, _, n in r.parts if n > 0))
            recv_exact_into(self.sock, buf)
            o = 0
            for sid, _, n in r.parts:
                deltas[sid] = None if n < 0 else buf[o : o + n]
                o += max(n, 0)
        sids = list(r.sids)
        node = self._node(r.server)
        if node is None:
            return PushReply({}, tuple(sids), gens={})
        try:
            if isinstance(r, OuterRequest):
                parts_of = {s: (errs[:, c0:c1], acts) for s, (c0, c1) in r.cols.items()}
                deltas = node.outer(parts_of, r.offset, out, inp, r.scale)
                if not deltas:
                    return PushReply({}, tuple(sids), gens={})
            reply: PushReply = node.push(r.event(None, deltas, True), r.urgent)
        except Exception as exc:
            return error_reply(exc)
        if isinstance(r, OuterRequest):  # the shards not primary here
            reply = replace(
                reply, moved=tuple(sorted(set(reply.moved) | (set(sids) - set(deltas))))
            )
        return reply

    def _confirmed(self, r: ConfirmedRequest) -> dict:
        node = self._node(r.server)
        if node is None:
            return ConfirmedReply({}, {}, {}, r.sids).to_wire()
        try:
            return node.confirmed(list(r.sids), r.urgent).to_wire()
        except Exception as exc:
            return error_reply(exc)

    def _replicate(self, h: dict) -> dict:
        """A primary's forward (:mod:`adam_dask.ps.plane.forward`): the snapshots' values are
        read into this connection's buffer and installed (copied into the shards) under the
        state's lock before the buffer is read into again."""
        metas = h["snaps"]
        sizes = [payload_floats(m) for m in metas]
        if "segment" in h:  # on this machine: the primary's segment, mapped here
            buf = self.segments[int(h["segment"])][: sum(sizes)]
        else:
            buf = self._buffer(sum(sizes))
            recv_exact_into(self.sock, buf)
        values, o = [], 0
        for n in sizes:
            values.append(buf[o : o + n])
            o += n
        node = self._node(h["server"])
        if node is None:
            return {"error": "ShardUnavailable", "message": "no such server here", "hint": None}
        try:
            return node.replicate(str(h["sender"]), snapshots_from(metas, values)).to_wire()
        except Exception as exc:
            return error_reply(exc)

    def _pull(self, r: PullRequest) -> None:
        node = self._node(r.server)
        if node is None:
            send_msg(self.sock, PullReply({}, r.sids).plane_header())
            return
        try:
            versions: dict[int, int] = {}
            ok, moved, views = self._read(r, node, list(r.sids), versions=versions)
        except Exception as exc:
            send_msg(self.sock, error_reply(exc))
            return
        reply = PullReply(dict.fromkeys(ok), tuple(moved), versions)
        send_msg(self.sock, reply.plane_header(), *views)

    def _push_pull(self, r: PushRequest, pull: PullRequest) -> None:
        """A push, then the values of the shards it was applied to, in one round trip (what a
        replica does every k images)."""
        reply = self._push(r)
        views: list = []
        node = self._node(r.server)
        if isinstance(reply, PushReply) and node is not None and reply.per_shard:
            sids = sorted(reply.per_shard)
            try:
                versions: dict[int, int] = {}
                ok, _, views = self._read(pull, node, sids, order=pull.sids, versions=versions)
                reply = replace(reply, pulled=tuple(ok), pulled_versions=versions)
            except Exception as exc:  # the push stands; the pusher pulls the Dask way
                logger.debug("data-plane pull after a push failed: %r", exc)
                reply, views = replace(reply, pulled=()), []
        send_msg(self.sock, _wire(reply), *views)

    def _read(
        self,
        r: PullRequest,
        node: Any,
        sids: list[int],
        order: Any = None,
        versions: dict | None = None,
    ) -> tuple[list[int], list[int], list]:
        """Copy the values of ``sids`` (primaries here) where the pusher reads them: the
        segment ``r`` names (Unix), or this connection's buffer, returned as views to send (TCP,
        in the order of ``order``, default ``sids``, with the sizes ``r.sizes``)."""
        order = [int(s) for s in (order if order is not None else sids)]
        stamps = r.stamps
        if r.segment is not None:
            seg = self.segments[r.segment]

            def dest(start: int, stop: int, i: int) -> np.ndarray:
                return seg[start:stop]

            ok, moved = node.read(sids, stamps, dest, versions)
            return ok, moved, []
        if r.sizes is None:
            raise ConnectionError("a pull over TCP that names no sizes")
        sizes = list(r.sizes)
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        buf = self._buffer(int(offs[-1]), pull=True)
        at = {s: i for i, s in enumerate(order)}

        def dest_tcp(start: int, stop: int, i: int) -> np.ndarray:
            j = at[sids[i]]
            if stop - start != sizes[j]:
                raise ConnectionError(f"a pull of {sizes[j]} floats for {stop - start}")
            return buf[offs[j] : offs[j] + sizes[j]]

        ok, moved = node.read(sids, stamps, dest_tcp, versions)
        views = [buf[offs[at[s]] : offs[at[s]] + sizes[at[s]]] for s in ok]
        return ok, moved, views


def _wire(reply: PushReply | dict) -> dict:
    """A push's answer as it goes on the wire (an error is a dict already)."""
    return reply.to_wire() if isinstance(reply, PushReply) else reply
