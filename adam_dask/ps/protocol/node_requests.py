"""What a client asks one node on the data path, as small frozen dataclasses, one per kind:
:class:`PushRequest` (a push's deltas: the whole server's, or a partition's range, with the
pull that may follow it), :class:`OuterRequest` (the dense offload's activations and errors),
:class:`PullRequest` (the primaries' values) and :class:`ConfirmedRequest` (what every copy
holds: the replay log's question).

Each is the part of a client :class:`~.request.Request` for the shards one primary holds
(:func:`node_request` makes it) and the only place its fields are written to a wire and read
back: ``to_wire()`` makes the header (a msgpack-able dict: the data plane's, or the argument of
the node's Dask method ``call``), ``from_wire()`` (or :func:`request_from_wire`, by ``op``)
reads it. The values travel beside the header: after it on a TCP plane, in a shared segment the
header names (``segment``, ``offset``) on the same machine, as the Dask call's second argument
otherwise. Every transport carries every field: the staleness ``bases`` and ``urgent`` reach the
node whichever way the request went. The simulation hands the objects over as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .mark import Mark
from .messages import Confirmed, Pull, Push
from .request import Request

__all__ = [
    "ConfirmedRequest",
    "NodeRequest",
    "OuterRequest",
    "PullRequest",
    "PushRequest",
    "node_request",
    "request_from_wire",
]

Part = tuple[int, int, int]  # (sid, its first float, its floats; -1: all zeros, none sent)


def _ints(d: Mapping[Any, Any] | None) -> dict[int, int]:
    return {} if d is None else {int(k): int(v) for k, v in d.items()}


def _mark(doc: Any) -> Mark | None:
    return None if doc is None else Mark.from_json(doc)


@dataclass(frozen=True, slots=True)
class PullRequest:
    """Read the values of the primaries ``sids`` (``stamps`` {sid: the generation the client
    knows}). Where they go: ``segment``, a shared segment the node writes them into at their
    shard's offsets (same machine); else they follow the answer, ``sizes`` floats each
    (TCP), or inside it (Dask). Inside a :class:`PushRequest` (its ``pull``), the shards the
    push was applied to are read after it."""

    server: str
    sids: tuple[int, ...]
    stamps: dict[int, int]
    segment: int | None = None
    sizes: tuple[int, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": "pull", "server": self.server, "stamps": self.stamps}
        out["sids"] = list(self.sids)
        _where(out, self, "segment")
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PullRequest:
        return cls(str(d["server"]), tuple(int(s) for s in d["sids"]), _ints(d["stamps"]),
                   *_where_from(d, "segment"))  # fmt: skip

    def event(self, req: Any) -> Pull:
        return Pull(req, self.sids, self.stamps)


def _where(out: dict[str, Any], pull: PullRequest, key: str) -> None:
    if pull.segment is not None:
        out[key] = pull.segment
    if pull.sizes is not None:
        out["sizes"] = list(pull.sizes)


def _where_from(d: Mapping[str, Any], key: str) -> tuple[int | None, tuple[int, ...] | None]:
    seg = d.get(key)
    sizes = d.get("sizes")
    return (None if seg is None else int(seg)), (
        None if sizes is None else tuple(int(n) for n in sizes)
    )


@dataclass(frozen=True, slots=True)
class PushRequest:
    """Add a push's deltas to the primaries of its ``parts`` ({sid, first float, floats or -1
    for zeros}): ``push_id`` (applied once however often it arrives), ``ack`` ("replay", "all"
    or "primary"), ``mark`` (what it covers of the pusher's data), ``urgent`` (the pusher waits
    for room in its replay log: forward to the backups now), ``bases`` {sid: the version the
    pusher last read} (the server optimizer's staleness; None: not known). ``segment`` and
    ``offset``: where the values lie in a shared segment (same machine; else they follow the
    header or ride beside it). ``pull``: read the shards back after the push."""

    server: str
    stamps: dict[int, int]
    push_id: int
    ack: str
    parts: tuple[Part, ...]
    mark: Mark | None = None
    urgent: bool = False
    bases: dict[int, int] | None = None
    segment: int | None = None
    offset: int = 0
    pull: PullRequest | None = None

    @property
    def sids(self) -> tuple[int, ...]:
        return tuple(p[0] for p in self.parts)

    def to_wire(self) -> dict[str, Any]:
        out = _push_head(self)
        out["parts"] = [list(p) for p in self.parts]
        if self.segment is not None:
            out["segment"], out["offset"] = self.segment, self.offset
        if self.pull is not None:
            out["pull"], out["pull_sids"] = True, list(self.pull.sids)
            _where(out, self.pull, "pull_segment")
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PushRequest:
        server, stamps, push_id, ack, mark, urgent, bases = _push_head_from(d)
        parts = tuple((int(s), int(a), int(n)) for s, a, n in d["parts"])
        seg = d.get("segment")
        pull = None
        if d.get("pull"):
            sids = tuple(int(s) for s in d["pull_sids"])
            pull = PullRequest(server, sids, stamps, *_where_from(d, "pull_segment"))
        return cls(server, stamps, push_id, ack, parts, mark, urgent, bases,
                   None if seg is None else int(seg), int(d.get("offset", 0)), pull)  # fmt: skip

    def event(self, req: Any, deltas: dict[int, np.ndarray | None], scanned: bool) -> Push:
        """The node's event for this push with its ``deltas`` {sid: values, None: zeros}
        (``scanned``: the pusher checked them for NaN/Inf)."""
        bases = None if self.bases is None else dict(self.bases)
        return Push(req, deltas, self.push_id, self.stamps, self.ack, self.mark, scanned, bases)


def _push_head(r: PushRequest | OuterRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"op": "push", "server": r.server, "stamps": r.stamps}
    out.update(push_id=r.push_id, ack=r.ack, urgent=r.urgent)
    out["mark"] = None if r.mark is None else r.mark.to_json()
    if r.bases is not None:
        out["bases"] = dict(r.bases)
    return out


def _push_head_from(d: Mapping[str, Any]) -> tuple:
    bases = d.get("bases")
    return (
        str(d["server"]),
        _ints(d["stamps"]),
        int(d["push_id"]),
        str(d["ack"]),
        _mark(d.get("mark")),
        bool(d.get("urgent")),
        None if bases is None else _ints(bases),
    )


@dataclass(frozen=True, slots=True)
class OuterRequest:
    """The dense offload's push: ``scale * errors.T @ activations`` added at ``offset`` to an
    ``(out, inp)`` row-major matrix, each primary computing its shards' part from the error
    columns ``cols[sid]`` and the ``batch`` rows of activations that follow. The rest as in
    :class:`PushRequest`."""

    server: str
    stamps: dict[int, int]
    push_id: int
    ack: str
    offset: int
    out: int
    inp: int
    scale: float
    batch: int
    cols: dict[int, tuple[int, int]]
    mark: Mark | None = None
    urgent: bool = False
    bases: dict[int, int] | None = None

    @property
    def sids(self) -> tuple[int, ...]:
        return tuple(self.cols)

    def to_wire(self) -> dict[str, Any]:
        out = _push_head(self)
        out["outer"] = {
            "offset": self.offset,
            "out": self.out,
            "inp": self.inp,
            "scale": self.scale,
            "batch": self.batch,
            "cols": {s: list(c) for s, c in self.cols.items()},
        }
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> OuterRequest:
        server, stamps, push_id, ack, mark, urgent, bases = _push_head_from(d)
        o = d["outer"]
        cols = {int(s): (int(c[0]), int(c[1])) for s, c in o["cols"].items()}
        return cls(server, stamps, push_id, ack, int(o["offset"]), int(o["out"]), int(o["inp"]),
                   float(o["scale"]), int(o["batch"]), cols, mark, urgent, bases)  # fmt: skip

    def event(self, req: Any, deltas: dict[int, np.ndarray | None], scanned: bool) -> Push:
        bases = None if self.bases is None else dict(self.bases)
        return Push(req, deltas, self.push_id, self.stamps, self.ack, self.mark, scanned, bases)


@dataclass(frozen=True, slots=True)
class ConfirmedRequest:
    """What every copy (and the checkpoint) holds of the primaries ``sids``; ``urgent``: the
    pusher waits for room, forward to the backups now."""

    server: str
    sids: tuple[int, ...]
    urgent: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": "confirmed", "server": self.server}
        out["sids"], out["urgent"] = list(self.sids), self.urgent
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ConfirmedRequest:
        return cls(str(d["server"]), tuple(int(s) for s in d["sids"]), bool(d.get("urgent")))

    def event(self, req: Any) -> Confirmed:
        return Confirmed(req, self.sids)


NodeRequest = PushRequest | OuterRequest | PullRequest | ConfirmedRequest


def request_from_wire(d: Mapping[str, Any]) -> NodeRequest:
    """The request a header says (its ``op``; a push with ``outer`` is the offload's)."""
    op = d.get("op")
    if op == "push":
        return OuterRequest.from_wire(d) if "outer" in d else PushRequest.from_wire(d)
    if op == "pull":
        return PullRequest.from_wire(d)
    if op == "confirmed":
        return ConfirmedRequest.from_wire(d)
    raise ValueError(f"no such data-path request {op!r}: push, pull or confirmed")


def node_request(
    req: Request,
    sids: tuple[int, ...],
    stamps: Mapping[int, int],
    server: str,
    shards: list[tuple[int, int]],
    *,
    segment: int | None = None,
    pull: tuple[int | None, tuple[int, ...] | None] | None = None,
) -> NodeRequest:
    """The part of ``req`` for the primary of ``sids`` (``stamps``: their generations in the
    client's routing). ``segment``: the shared segment a push's values lie in at their shards'
    offsets; ``pull`` (segment, sizes): where the values of a pull, or of a push's pull, go
    (see :class:`PullRequest`; None: inside a Dask answer)."""
    sl = tuple(int(s) for s in sids)
    st = {int(s): int(g) for s, g in stamps.items()}
    where = pull if pull is not None else (None, None)
    if req.op == "confirmed":
        return ConfirmedRequest(server, sl, req.urgent)
    if req.op == "pull":
        return PullRequest(server, sl, st, *where)
    if req.op != "push":
        raise ValueError(f"{req.op!r} is a control call, not a data-path request")
    bases = None
    if req.bases:
        bases = {s: int(req.bases[s]) for s in sl if s in req.bases} or None
    if req.outer is not None:
        o = req.outer
        batch = int(np.shape(o.activations)[0])
        cols = {s: (int(o.cols[s][0]), int(o.cols[s][1])) for s in sl}
        return OuterRequest(server, st, req.push_id, req.ack, int(o.offset), int(o.out),
                            int(o.inp), float(o.scale), batch, cols, req.mark, req.urgent,
                            bases)  # fmt: skip
    parts = []
    for s in sl:
        a, b = shards[s]
        zero = req.nonzero is not None and not req.nonzero[s]
        parts.append((s, a, -1 if zero else b - a))
    p = PullRequest(server, sl, st, *where) if req.pull else None
    return PushRequest(server, st, req.push_id, req.ack, tuple(parts), req.mark, req.urgent,
                       bases, segment, 0, p)  # fmt: skip
