"""Replication on the data plane: a primary's forwards to its backups over the same sockets as
the pushes, instead of a Dask actor call each.

Every ``forward-interval`` a primary sends each backup one batch of snapshots (one per shard it
holds for that backup: the values at a version, the push ids and marks since the backup's
last). Over the actor call, the values were pickled, framed and handed through both workers'
event loops. Here the primary's forward task hands the batch to a thread. On the same machine it writes the
snapshots into a ``memfd`` segment of that backup's, handed over once as a pusher's are, and
sends a header naming it (the snapshots' metadata); the backup's connection thread installs
them from its mapping. To another machine the values follow the header straight from the
snapshots' arrays (the kernel's copy only) and the backup reads them into its buffer. Either
way the backup installs under the node state's lock
(:meth:`~adam_dask.ps.runtime.node_plane.NodePlane.replicate`): the one copy on that side. The answer (what the backup now holds, what it refused) comes back on the
same socket.

Nothing of the protocol changes: the backup's :class:`~adam_dask.ps.protocol.node_state.NodeState`
handles the same ``Replicate`` event and the primary the same ``ForwardDone``. A forward that
fails on the plane (the backup gone, frozen past ``adam.ps.plane-timeout``, its plane not
reachable) goes the Dask way with the same snapshots; a backup that gets a batch twice (a
frozen backup that wakes and reads the plane's copy after the actor's) installs only what is
newer than what it holds, so a duplicate changes nothing.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

from ...net.framing import recv_msg, send_msg
from ..protocol.replies import ReplicateReply
from ..protocol.shard import Mark, ShardCopy
from .channels import Channels, Segment

logger = logging.getLogger(__name__)

__all__ = ["ForwardChannels", "payload_floats", "snapshot_header", "snapshots_from"]


def snapshot_header(snap: ShardCopy) -> dict:
    """A snapshot's metadata (its values, then its optimizer state, travel after the
    header: ``floats`` each, ``state`` vectors of state)."""
    return {
        "shard": snap.shard,
        "start": snap.start,
        "stop": snap.stop,
        "version": snap.version,
        "floats": int(snap.values.shape[0]),
        "state": len(snap.payloads()) - 1,
        "ids": [[int(v), int(p)] for v, p in snap.ids],
        "gen": snap.gen,
        "full": snap.full,
        "base": snap.base,
        "marks": [m.to_json() for m in snap.marks],
    }


def payload_floats(meta: dict) -> int:
    """The floats that follow the header for one snapshot (values and state)."""
    return int(meta["floats"]) * (1 + int(meta.get("state", 0)))


def snapshots_from(metas: list[dict], payloads: list[Any]) -> tuple[ShardCopy, ...]:
    """The snapshots a header describes, over the arrays read after it (one per snapshot:
    its values, then its optimizer state)."""
    out = []
    for m, p in zip(metas, payloads, strict=True):
        n = int(m["floats"])
        out.append(
            ShardCopy(
                int(m["shard"]),
                int(m["start"]),
                int(m["stop"]),
                int(m["version"]),
                p[:n],
                tuple((int(a), int(b)) for a, b in m["ids"]),
                int(m["gen"]),
                bool(m["full"]),
                tuple(Mark.from_json(x) for x in m["marks"]),
                p[n : 2 * n] if int(m.get("state", 0)) else None,
                int(m.get("base", -1)),
            )
        )
    return tuple(out)


class ForwardChannels:
    """A primary node's data-plane connections to its backups, by (address, actor key).

    Used from one forward thread per backup at a time (a node sends a backup its next batch only
    once the last one is answered)."""

    def __init__(self, server_id: str, mode: str, timeout: float, tls: Any = None):
        self._channels = Channels(server_id, 0, mode, timeout, lambda: tls)
        # on this machine, a segment per backup the snapshots are written into and handed over
        # as pushes are (a frozen backup may read one after the call was given up: that one
        # is never written again, the next forward takes a new one)
        self._segments: dict[tuple[str, str], Segment] = {}
        self._ids = itertools.count(1 << 30)  # apart from the pushers' segment ids
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str], threading.Lock] = {}
        self.counts = {"plane": 0, "failed": 0}

    def knows(self, addr: str, key: str) -> bool:
        """Whether the backup's data-plane endpoint is known (else ask its actor first)."""
        return self._channels.knows(addr, key)

    def remember(self, addr: str, key: str, endpoint: dict) -> None:
        self._channels.remember(addr, key, endpoint)

    def forward(
        self, addr: str, key: str, sender: str, snaps: tuple[ShardCopy, ...]
    ) -> ReplicateReply | None:
        """Send ``snaps`` to the backup at ``addr`` and return its answer (what it holds now,
        what it refused), or None when the plane could not carry it (the caller goes the Dask
        way). One call per connection at a time: a forward whose task was cancelled while its
        thread waits keeps the connection until it ends."""
        with self._lock:
            call_lock = self._calls.setdefault((addr, key), threading.Lock())
        with call_lock:
            with self._lock:
                ch = self._channels.get(addr, key, self._no_endpoint)
            if ch is None:
                return None
            header: dict[str, Any] = {
                "op": "replicate",
                "server": self._channels.server_id,
                "sender": sender,
                "snaps": [snapshot_header(s) for s in snaps],
            }
            seg = None
            try:
                if ch.unix:
                    arrays = [p for s in snaps for p in s.payloads()]
                    seg = self._segment((addr, key), sum(a.shape[0] for a in arrays))
                    o = 0
                    for a in arrays:
                        n = a.shape[0]
                        seg.array[o : o + n] = a
                        o += n
                    ch.share(seg)
                    header["segment"] = seg.id
                    send_msg(ch.sock, header)
                else:
                    send_msg(ch.sock, header, *(p for s in snaps for p in s.payloads()))
                reply = recv_msg(ch.sock)
            except (OSError, ValueError) as exc:
                logger.info("forward to %s on the data plane failed (%r): the Dask path", addr, exc)
                with self._lock:
                    self._channels.fail(addr, key, ch)
                    if seg is not None:  # the backup may still read it: never written again
                        _close(self._segments.pop((addr, key), None))
                self.counts["failed"] += 1
                return None
        if "error" in reply:
            logger.info("forward to %s refused on the data plane: %s", addr, reply["message"])
            return None
        self.counts["plane"] += 1
        return ReplicateReply.from_wire(reply)

    def _segment(self, k: tuple[str, str], floats: int) -> Segment:
        """The segment of backup ``k``, at least ``floats`` long (a larger one replaces it)."""
        seg = self._segments.get(k)
        if seg is None or seg.array.shape[0] < floats:
            _close(seg)  # a backup that mapped it keeps its mapping
            seg = Segment(self._channels.pool, next(self._ids), max(floats, 1))
            self._segments[k] = seg
        return seg

    def _no_endpoint(self) -> dict:
        raise ConnectionError("no data-plane endpoint known for this backup yet")

    def forget(self, addr: str, key: str) -> None:
        """``addr`` no longer hosts that backup: drop its connection and endpoint."""
        with self._lock:
            self._channels.drop(addr, key)

    def close(self) -> None:
        with self._lock:
            self._channels.close()
            for seg in self._segments.values():
                _close(seg)
            self._segments.clear()


def _close(seg: Segment | None) -> None:
    """Let go of a segment's descriptor (the mappings stay while anyone maps it)."""
    if seg is not None:
        seg.close_fd()
