"""The DATA worker's side of the images' data plane: batches from a partition server straight
to a reader's socket, with no Dask actor call and no hop to the worker's event loop.

One :class:`ImagePlane` per DATA worker process serves every
:class:`~._partition.PartitionServer` of the process (each DataServer registers its own under a
random id). It listens on

* a Unix socket in the abstract namespace (same machine, same network namespace): each
  connection gets an :class:`Arena`, a ``memfd`` of batch slots, handed to the reader once
  (``SCM_RIGHTS``) in the answer to its ``open``; the producers build the stream's batches
  *in* the slots (the gather of the stored pixels, or the augmentation, writes there), and a
  batch's answer names its slot. The values never cross a socket. The segment has no name in
  any file system: the kernel frees it when the last mapping goes, SIGKILL included;
* TCP on the worker's host (TLS with Dask's certificates on a ``tls://`` cluster,
  :mod:`adam_dask.net.tls`): the batch's bytes follow its header, sent straight from the batch
  (the kernel's copy only).

One connection is one stream of one partition, served by one thread: ``open`` (the stream's
share, minus the batches already delivered), then ``next`` requests, each answered in order
with a batch, the end, or an error. A reader frees the slots it is done with in its next
request. A connection that ends (the reader closed it, or died) closes its stream and unmaps
its arena. The first message must carry the plane's token, which a reader gets only from the
DataServer actor (``DataServer.plane``, over Dask's comm): the plane admits no one Dask would
not.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import socket
import threading
import uuid
import weakref
from typing import Any

import numpy as np

from ...errors import AdamError
from ...net.framing import recv_msg, send_msg
from ...net.listen import Listeners
from ._messages import Batch, End, ServerClosed, ServingError, StreamExpired
from ._partition import PartitionServer

logger = logging.getLogger(__name__)

__all__ = ["Arena", "ImagePlane", "image_plane"]

_lock = threading.Lock()
_plane: ImagePlane | None = None


def image_plane(worker: Any) -> ImagePlane:
    """The process's image plane (started on first use), listening next to ``worker`` (TCP,
    TLS with the worker's certificate on a ``tls://`` cluster)."""
    global _plane
    with _lock:
        if _plane is None:
            _plane = ImagePlane(worker)
        return _plane


class Arena:
    """``slots`` batch buffers of ``slot_bytes`` each in one ``memfd`` mapping, shared with one
    reader. A producer takes a slot (:meth:`array`), the reader frees it once it has read it."""

    def __init__(self, slots: int, slot_bytes: int):
        self.slots, self.slot_bytes = int(slots), max(int(slot_bytes), 64)
        self.nbytes = self.slots * self.slot_bytes
        self.fd: int | None = os.memfd_create(f"adam-data-{os.getpid()}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes)
        self._bytes: np.ndarray | None = np.frombuffer(self._map, np.uint8)
        self._base = self._bytes.ctypes.data
        self._free = list(range(self.slots - 1, -1, -1))
        self._lock = threading.Lock()

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        """An array of ``shape`` in a free slot; ``None`` when none is free (or it is too big):
        the batch is then made in ordinary memory and sent inline."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        with self._lock:
            if self._bytes is None or n > self.slot_bytes or not self._free:
                return None
            slot = self._free.pop()
            raw = self._bytes[slot * self.slot_bytes : slot * self.slot_bytes + n]
        return raw.view(dt).reshape(shape)

    def slot_of(self, x: np.ndarray) -> int | None:
        """The slot ``x`` lies in, when it was made by :meth:`array`."""
        off = x.ctypes.data - self._base
        if 0 <= off < self.nbytes and off % self.slot_bytes == 0:
            return off // self.slot_bytes
        return None

    def free(self, slots: list[int]) -> None:
        with self._lock:
            for s in slots:
                s = int(s)
                if 0 <= s < self.slots and s not in self._free:
                    self._free.append(s)

    def hand_over(self, sock: socket.socket) -> None:
        """Send the segment's file descriptor (once), then close it here: the mapping stays."""
        assert self.fd is not None
        socket.send_fds(sock, [b"s"], [self.fd])
        os.close(self.fd)
        self.fd = None

    def close(self) -> bool:
        """Drop the mapping (unmapped when the last view of it goes); whether it is unmapped
        now (False: a view of it still exists)."""
        with self._lock:
            self._bytes = None
            self._free.clear()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self._map.close()
        except BufferError:  # a batch still buffered holds a view: unmapped when it goes
            return False
        return True


class ImagePlane:
    """The image plane of one DATA worker process: its listeners
    (:class:`~adam_dask.net.listen.Listeners`) and the partition servers it serves."""

    def __init__(self, worker: Any):
        self.servers: weakref.WeakValueDictionary[str, PartitionServer] = (
            weakref.WeakValueDictionary()
        )
        self.listeners = Listeners(
            worker,
            "adam-data",
            "adam-data-plane",
            lambda sock, unix: _Connection(self, sock, unix).run(),
        )

    def register(self, core: PartitionServer) -> dict:
        """Serve ``core``; its endpoint (what a reader needs to connect, the token included)."""
        sid = uuid.uuid4().hex
        self.servers[sid] = core
        return {**self.listeners.endpoint(), "server": sid}


def _reply_of(msg: Any) -> dict:
    """A non-batch message as a reply header."""
    match msg:
        case End():
            return {"kind": "end"}
        case ServingError():
            return {"kind": "error", "message": msg.message, "hint": msg.hint, "url": msg.url}
        case ServerClosed():
            return {
                "kind": "closed",
                "message": msg.message,
                "hint": msg.hint,
                "ending": msg.ending,
            }
        case StreamExpired():
            return {"kind": "expired", "message": msg.message}
    raise TypeError(f"not a serving message: {msg!r}")  # pragma: no cover


class _Connection:
    """One reader's stream: its partition server, stream id and arena (Unix)."""

    def __init__(self, plane: ImagePlane, sock: socket.socket, unix: bool):
        self.plane, self.sock, self.unix = plane, sock, unix
        self.core: PartitionServer | None = None
        self.sid: str | None = None
        self.arena: Arena | None = None

    def run(self) -> None:
        try:
            self.sock = self.plane.listeners.admit(self.sock, self.unix)
            while True:
                h = recv_msg(self.sock)
                op = h.get("op")
                if op == "open":
                    self._open(h)
                elif op == "next":
                    self._next(h)
                elif op == "close":
                    return
                else:
                    raise ConnectionError(f"unknown image-plane op {op!r}")
        except (ConnectionError, OSError, ValueError) as exc:
            logger.debug("image-plane connection closed: %r", exc)
        except Exception as exc:  # a peer that broke the protocol: close, serve the others
            logger.warning("image-plane connection closed on a malformed message: %r", exc)
        finally:
            self._end()

    def _end(self) -> None:
        self.sock.close()
        if self.core is not None and self.sid is not None:
            self.core.close_stream(self.sid)  # its buffered batches (views of the arena) go
        self.core = None
        if self.arena is not None:
            # a view caught in a cycle would keep the segment mapped: collected, then closed
            # again. Only then: a full collection holds the GIL for tens of ms in a worker,
            # which stalled every stream of the DATA worker at each stream's end
            if not self.arena.close():
                gc.collect()
                self.arena.close()
            self.arena = None

    def _open(self, h: dict) -> None:
        if self.core is not None:
            raise ConnectionError("one stream per image-plane connection")
        core = self.plane.servers.get(str(h["server"]))
        if core is None:
            send_msg(self.sock, {"kind": "lost", "message": "this DataServer was released"})
            return
        shm = self.unix and bool(h.get("shm", True))
        if shm:
            # a slot holds a batch as the producers make it: stored uint8, or augmented float32
            per_image = int(np.prod(core.shape)) * (4 if core.settings.augment is not None else 1)
            slots = core.settings.buffer_batches + int(h.get("prefetch", 4)) + 2
            self.arena = Arena(slots, int(h["batch_size"]) * per_image)
        try:
            n = core.open_stream(
                str(h["sid"]),
                int(h["epoch"]),
                int(h["replica"]),
                int(h["replicas"]),
                int(h["batch_size"]),
                [int(k) for k in h.get("done", ())],
                alloc=None if self.arena is None else self.arena.array,
            )
        except AdamError as exc:
            send_msg(self.sock, _reply_of(ServerClosed(exc.message, exc.hint, core.ending)))
            return
        self.core, self.sid = core, str(h["sid"])
        if self.arena is None:
            send_msg(self.sock, {"kind": "opened", "n": n})
        else:
            send_msg(self.sock, {"kind": "opened", "n": n, "segment": self.arena.nbytes})
            self.arena.hand_over(self.sock)

    def _next(self, h: dict) -> None:
        core, sid = self.core, self.sid
        if core is None or sid is None:
            raise ConnectionError("next before open")
        if self.arena is not None and h.get("free"):
            self.arena.free(h["free"])
        msg = core.take(sid)
        if not isinstance(msg, Batch):
            send_msg(self.sock, _reply_of(msg))
            return
        core.count_transport("plane")
        x = msg.x
        header: dict[str, Any] = {
            "kind": "batch",
            "k": msg.k,
            "shape": list(x.shape),
            "dtype": x.dtype.str,
            "y": np.ascontiguousarray(msg.y, np.int64).tobytes(),
            "idx": np.ascontiguousarray(msg.idx, np.int64).tobytes(),
        }
        slot = None if self.arena is None else self.arena.slot_of(x)
        if slot is not None and self.arena is not None:
            header["slot"], header["offset"] = slot, slot * self.arena.slot_bytes
            send_msg(self.sock, header)
        else:
            send_msg(self.sock, header, np.ascontiguousarray(x))
