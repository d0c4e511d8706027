"""The pusher's side of the data plane: a push or a pull goes from the calling thread straight to
a socket, with no hop to an event loop and no Dask actor call.

The path of one push from a replica (``AsyncExchange``): the training thread takes its update
into a :class:`Segment` of the handle's pool (``Updates.take(out=)``: the sum of the threads'
accumulators is written once, there) and queues it; the communicator thread calls
``ParameterServer.push_pull(delta, out)``, which scans it once (NaN/Inf and which shards are
all zeros, :func:`~adam_dask.ps.kernels.scan_delta`) and sends each primary its shards' part:

* same machine (a Unix socket in the same network namespace): the segment (a ``memfd``) was
  handed to the node once; the push is a header naming it (no copy of the values at all);
* other machines: the header, then the values straight from the segment (``sendall``: the
  kernel's copy only).

Held pushes (``ack="replay"``) keep a reference on the segment instead of a copy of the
values; the segment goes back to the pool when the caller released it and every held part is
durable. A call that fails or times out closes its channel and *poisons* the segment it used
(a frozen node may still read it after it wakes: it is never written again), and what that
node did not answer goes the Dask way (:mod:`adam_dask.ps._pushing`: routing refresh, fail-over
waits, replay), with the same push id, so nothing is applied twice.

``adam.ps.data-plane``: ``auto`` (shared memory on the same machine, TCP otherwise), ``tcp``
(never shared memory), ``dask`` (every call as a Dask actor call, the former path).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import config
from ..errors import ConfigError, ShardUnavailable, UpdateRejected
from ._replay import HeldPush
from ._wire import recv_exact_into, recv_msg, send_msg

logger = logging.getLogger(__name__)

__all__ = ["Channel", "Pool", "Segment"]

_RETRY_DOWN = 5.0  # seconds before a node that refused a connection is tried again
_ERRORS = {"UpdateRejected": UpdateRejected, "ShardUnavailable": ShardUnavailable}


class Segment:
    """A float32 buffer of the pool: a ``memfd`` mapping (shareable with nodes on this machine)
    or plain memory. ``refs``: the caller's and the held pushes'; ``poisoned``: a node may
    still read it, so it is never written again."""

    __slots__ = ("array", "fd", "id", "poisoned", "pool", "refs")

    def __init__(self, pool: Pool, sid: int, floats: int):
        self.pool, self.id, self.refs, self.poisoned = pool, sid, 0, False
        self.fd: int | None = None
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create(f"adam-ps-{os.getpid()}-{sid}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, max(floats * 4, 1))
            self.array = np.frombuffer(mmap.mmap(self.fd, max(floats * 4, 1)), np.float32)
            self.array = self.array[:floats]
        else:  # pragma: no cover - not Linux: TCP only
            self.array = np.empty(floats, np.float32)

    def release(self) -> None:
        self.pool.release(self)


class Pool:
    """Segments of one server's size, reused once nothing refers to them."""

    def __init__(self, floats: int):
        self.floats = int(floats)
        self._free: list[Segment] = []
        self._by_array: dict[int, Segment] = {}
        self._ids = 0
        self._lock = threading.Lock()

    def take(self) -> Segment:
        with self._lock:
            seg = self._free.pop() if self._free else None
            if seg is None:
                self._ids += 1
                seg = Segment(self, self._ids, self.floats)
                self._by_array[id(seg.array)] = seg
            seg.refs = 1
            return seg

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
            if seg.refs == 0 and not seg.poisoned:
                self._free.append(seg)
            elif seg.refs == 0:
                self._by_array.pop(id(seg.array), None)
                if seg.fd is not None:  # nodes that mapped it keep their mapping
                    os.close(seg.fd)
                    seg.fd = None

    def poison(self, seg: Segment) -> None:
        with self._lock:
            seg.poisoned = True


class Channel:
    """A connection to one node's data plane."""

    def __init__(self, sock: socket.socket, unix: bool, server_id: str):
        self.sock, self.unix, self.server_id = sock, unix, server_id
        self.shared: set[int] = set()  # segment ids the node has mapped
        self.pull_seg: Segment | None = None

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

    def __init__(self, server_id: str, floats: int, mode: str, timeout: float):
        if mode not in ("auto", "tcp"):
            raise ConfigError(f"adam.ps.data-plane is {mode!r}", "use auto, tcp or dask")
        self.server_id, self.mode, self.timeout = server_id, mode, float(timeout)
        self.pool = Pool(floats)
        self._open: dict[tuple[str, str], Channel] = {}
        self._down: dict[tuple[str, str], float] = {}
        self._endpoints: dict[tuple[str, str], dict] = {}
        self.lock = threading.Lock()  # one call of this handle at a time
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
                raise ConnectionError("the node has no TCP data plane (a TLS cluster)")
            host, port = ep["tcp"]
            s = socket.create_connection((host, int(port)), timeout=self.timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        for ch in self._open.values():
            ch.close()
        self._open.clear()


def rebuilt_error(reply: dict) -> Exception:
    cls = _ERRORS.get(reply["error"])
    if cls is None:
        return ConnectionError(f"{reply['error']}: {reply['message']}")
    return cls(reply["message"], reply.get("hint"), shard=reply.get("shard"))


# -- the handle's calls --------------------------------------------------------------------------


class PlaneCalls:
    """Push and pull over the data plane (mixed into ParameterServer before the Dask path)."""

    server_id: str
    size: int
    shards: list[tuple[int, int]]
    _routing: list[list[str]]
    _gens: list[int]
    _nodes: dict[str, str]
    _log: Any
    _channels: Channels | None
    _plane_answered: float

    if TYPE_CHECKING:  # Transport's, after this class in the handle's bases

        def _run(self, coro_fn: Any, *args: Any, **kwargs: Any) -> Any: ...

        def _primary_of(self) -> dict[int, tuple[str, int]]: ...

        def _confirm(self, addr: str, reply: dict, key: str = "confirmed") -> None: ...

    def _plane(self) -> Channels | None:
        mode = str(config.get("ps.data-plane"))
        if mode == "dask":
            return None
        if self._channels is None:
            self._channels = Channels(
                self.server_id, self.size, mode, float(config.get("ps.plane-timeout"))
            )
        return self._channels

    def buffer(self) -> np.ndarray:
        """A float32 array of the server's size from the handle's pool, for a delta to push
        with :meth:`push` by reference; give it back with :meth:`release` (the server keeps
        it as long as it needs it, then reuses it)."""
        plane = self._plane()
        if plane is None:
            return np.empty(self.size, np.float32)
        return plane.pool.take().array

    def release(self, array: np.ndarray) -> None:
        """The caller is done with a :meth:`buffer` (it is not written again by the caller)."""
        plane = self._channels
        seg = None if plane is None else plane.pool.of(array)
        if seg is not None:
            seg.release()

    def _channel(self, plane: Channels, addr: str) -> tuple[str, Channel | None]:
        """(the node's actor key, its channel or None: the Dask path then)."""
        key = self._nodes.get(addr, "")
        return key, plane.get(addr, key, partial(self._endpoint, addr, key))

    def _endpoint(self, addr: str, key: str) -> dict:
        from ._rpc import call_actor

        async def ask(rpc: Any, sched: Any) -> dict:
            timeout = float(config.get("ps.call-timeout"))
            return await call_actor(rpc, addr, key, "plane", timeout=timeout)

        return self._run(ask)

    def _routed(self) -> dict[int, tuple[str, int]] | None:
        """{sid: (primary, generation)} when every shard has one and no held push must be
        replayed first; else None (the Dask path does both)."""
        if not self._routing:
            return None
        prim = self._primary_of()
        if len(prim) != len(self.shards):
            return None
        if self._log and self._log.moved(prim):
            return None
        return prim

    def _plane_push(
        self,
        delta: np.ndarray,
        ack: str,
        mark: Any,
        push_id: int,
        nonzero: np.ndarray,
        pull: np.ndarray | None = None,
    ) -> tuple[list[int], set[int]]:
        """Send ``delta`` to the primaries over the data plane (and, with ``pull``, read the
        values of the shards back into it in the same round trip); returns the shards left for
        the Dask path (moved, or their node did not answer) and the shards pulled."""
        plane = self._plane()
        prim = self._routed() if plane is not None else None
        everything: tuple[list[int], set[int]] = (list(range(len(self.shards))), set())
        if plane is None or prim is None:
            return everything
        keep = ack == "replay"
        if keep and self._log.nbytes > int(config.get("ps.replay-bytes")):
            return everything  # the Dask path sheds, or waits for room
        with plane.lock:
            seg = plane.pool.of(delta)
            own = seg is None
            if own:  # a caller's array: one copy into a segment (to share it, to hold it)
                seg = plane.pool.take()
                np.copyto(seg.array, delta)
            assert seg is not None
            try:
                rest, pulled = self._send_parts(
                    plane, seg, prim, ack, mark, push_id, nonzero, keep, pull
                )
                plane.counts["pushes"] += 1
                plane.counts["to_dask"] += bool(rest)
                return rest, pulled
            finally:
                if own:
                    seg.release()

    def _send_parts(
        self,
        plane: Channels,
        seg: Segment,
        prim: dict[int, tuple[str, int]],
        ack: str,
        mark: Any,
        push_id: int,
        nonzero: np.ndarray,
        keep: bool,
        pull: np.ndarray | None,
    ) -> tuple[list[int], set[int]]:
        groups: dict[str, list[int]] = {}
        pulled: set[int] = set()
        targets: dict[str, Segment] = {}  # where each node writes the pulled values
        for sid, (addr, _) in prim.items():
            groups.setdefault(addr, []).append(sid)
        rest: list[int] = []
        sent: list[tuple[str, str, Channel, list[int]]] = []
        values = seg.array
        for addr, sids in groups.items():
            key, ch = self._channel(plane, addr)
            if ch is None:
                rest += sids
                continue
            parts = []
            for s in sids:
                a, b = self.shards[s]
                parts.append([s, a, (b - a) if nonzero[s] else -1])
            header = {
                "op": "push",
                "server": self.server_id,
                "push_id": push_id,
                "ack": ack,
                "stamps": {s: self._gens[s] for s in sids},
                "mark": None if mark is None else mark.to_json(),
                "parts": parts,
            }
            if pull is not None:
                header["pull"], header["pull_sids"] = True, sids
            try:
                if pull is not None and ch.unix:
                    targets[addr] = self._pull_target(plane, ch, pull)
                    header["pull_segment"] = targets[addr].id
                elif pull is not None:
                    header["sizes"] = [self.shards[s][1] - self.shards[s][0] for s in sids]
                if ch.unix:
                    ch.share(seg)
                    header["segment"], header["offset"] = seg.id, 0
                    send_msg(ch.sock, header)
                else:
                    views = [values[p[1] : p[1] + p[2]] for p in parts if p[2] > 0]
                    send_msg(ch.sock, header, *views)
            except OSError as exc:
                logger.debug("data-plane push to %s failed (%r)", addr, exc)
                plane.fail(addr, key, ch, seg)
                rest += sids
                continue
            sent.append((addr, key, ch, sids))
        error: Exception | None = None
        for addr, key, ch, sids in sent:
            try:
                reply = recv_msg(ch.sock)
                for s in reply.get("pulled", ()):
                    assert pull is not None
                    self._pulled(ch, int(s), pull, targets.get(addr))
                    pulled.add(int(s))
            except (OSError, ValueError) as exc:
                logger.debug("no data-plane answer from %s (%r): the Dask path", addr, exc)
                plane.fail(addr, key, ch, seg, plane.pool.of(pull) if pull is not None else None)
                rest += sids
                continue
            if "error" in reply:
                refused = rebuilt_error(reply)
                if isinstance(refused, UpdateRejected):
                    error = refused
                else:
                    rest += sids
                continue
            rest += [int(s) for s in reply["moved"]]
            if keep:
                for sid, version in reply["per_shard"].items():
                    sid = int(sid)
                    a, b = self.shards[sid]
                    part = values[a:b] if nonzero[sid] else None
                    if part is not None:
                        plane.pool.hold(seg)
                    held = HeldPush(
                        push_id,
                        "push",
                        part,
                        addr,
                        int(reply["gens"][sid]),
                        int(version),
                        0 if part is None else part.nbytes,
                        mark,
                        lease=seg if part is not None else None,
                    )
                    self._log.add(sid, held)
            self._confirm(addr, reply)
            self._plane_answered = time.monotonic()
        if error is not None:
            raise error
        return sorted(rest), pulled

    def _pull_target(self, plane: Channels, ch: Channel, out: np.ndarray) -> Segment:
        """The segment a node on this machine writes pulled values into: ``out`` itself when
        it is a :meth:`buffer` (no copy on this side), else the channel's own."""
        seg = plane.pool.of(out)
        if seg is None or seg.poisoned:
            if ch.pull_seg is None:
                ch.pull_seg = plane.pool.take()
            seg = ch.pull_seg
        ch.share(seg)
        return seg

    def _pulled(self, ch: Channel, sid: int, out: np.ndarray, target: Segment | None) -> None:
        """Shard ``sid``'s pulled values into ``out`` (read from the socket, or copied from
        the ``target`` segment the node wrote them to unless that is ``out`` itself)."""
        a, b = self.shards[sid]
        if not ch.unix:
            recv_exact_into(ch.sock, out[a:b])
        elif target is not None and target.array is not out:
            np.copyto(out[a:b], target.array[a:b])

    def _plane_pull(self, sids: list[int], out: np.ndarray) -> list[int]:
        """Fill ``out`` with the shards ``sids`` over the data plane; returns those left for
        the Dask path."""
        plane = self._plane()
        prim = self._routed() if plane is not None else None
        if plane is None or prim is None:
            return sids
        groups: dict[str, list[int]] = {}
        for s in sids:
            groups.setdefault(prim[s][0], []).append(s)
        rest: list[int] = []
        targets: dict[str, Segment] = {}
        with plane.lock:
            sent = []
            for addr, group in groups.items():
                key, ch = self._channel(plane, addr)
                if ch is None:
                    rest += group
                    continue
                header: dict[str, Any] = {
                    "op": "pull",
                    "server": self.server_id,
                    "sids": group,
                    "stamps": {s: self._gens[s] for s in group},
                }
                try:
                    if ch.unix:
                        targets[addr] = self._pull_target(plane, ch, out)
                        header["segment"] = targets[addr].id
                    else:
                        header["sizes"] = [self.shards[s][1] - self.shards[s][0] for s in group]
                    send_msg(ch.sock, header)
                except OSError:
                    plane.fail(addr, key, ch)
                    rest += group
                    continue
                sent.append((addr, key, ch, group))
            for addr, key, ch, group in sent:
                try:
                    reply = recv_msg(ch.sock)
                    if "error" in reply:
                        raise rebuilt_error(reply)
                    for s in reply["per_shard"]:
                        self._pulled(ch, int(s), out, targets.get(addr))
                except Exception as exc:
                    logger.debug("data-plane pull from %s failed (%r)", addr, exc)
                    plane.fail(addr, key, ch, plane.pool.of(out))
                    rest += group
                    continue
                rest += [int(s) for s in reply["moved"]]
            plane.counts["pulls"] += 1
            plane.counts["to_dask"] += bool(rest)
        return sorted(rest)
