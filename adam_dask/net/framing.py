"""The planes' framing: one message is a 4-byte little-endian length, a msgpack header, then
the raw bytes its header announces (over TCP) or nothing (shared memory: the header names a
buffer both sides map).

Socket helpers that move bytes without copying them in user space: ``send_msg`` writes the
header and each payload straight from its buffer; ``recv_exact_into`` reads into a buffer the
caller owns. Blocking sockets only (the data plane runs in plain threads); a closed peer raises
:class:`ConnectionError`.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from typing import Any

import msgpack
import numpy as np

__all__ = ["recv_exact_into", "recv_msg", "send_msg"]

_LEN = struct.Struct("<I")
MAX_HEADER = 16 << 20  # a header longer than this is a protocol error, not an allocation
_packers = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's header packer, made once: ``msgpack.packb`` makes a new one per call, and
    each allocates a 256 KiB buffer, which in a Dask worker (whose nanny sets
    ``MALLOC_TRIM_THRESHOLD_``, turning off glibc's adaptive mmap threshold) is an mmap, 64
    page faults and an munmap per message: measured as a quarter of a pushing thread's CPU."""
    p = getattr(_packers, "p", None)
    if p is None:
        p = _packers.p = msgpack.Packer(use_bin_type=True)
    return p


def send_msg(sock: socket.socket, header: dict, *payloads: Any) -> None:
    """Send ``header`` and then each payload (arrays or bytes-like) as they are: one
    ``sendmsg`` for all of them on a plain socket (the peer wakes once per message), one
    ``sendall`` each on a TLS one."""
    head = _packer().pack(header)
    views = [memoryview(_LEN.pack(len(head)) + head)]
    views += [v for v in (_bytes_view(p) for p in payloads) if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:  # drop what went, resume mid-buffer
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def _bytes_view(buf: Any) -> memoryview:
    """A flat byte view of an array or a bytes-like object (no copy)."""
    if isinstance(buf, np.ndarray):
        return buf.data.cast("B")
    return memoryview(buf)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_exact_into(sock: socket.socket, view: Any) -> None:
    """Fill ``view`` (a writable buffer: a bytearray, a float32 array slice) from ``sock``."""
    mv = _bytes_view(view)
    got, n = 0, mv.nbytes
    while got < n:
        k = sock.recv_into(mv[got:], n - got)
        if k == 0:
            raise ConnectionError("the data-plane peer closed the connection")
        got += k


def recv_msg(sock: socket.socket) -> dict:
    """The next header from ``sock``."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"a data-plane header of {n} bytes: not a peer of ours")
    return msgpack.unpackb(_recv_exact(sock, n), raw=False, strict_map_key=False)
