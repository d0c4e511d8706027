"""What the parameter server's machines answer, as small frozen dataclasses: the ``value`` of a
:class:`~adam_dask.ps.protocol.messages.Reply` to a data-path request or a heartbeat, read by
attribute (``reply.per_shard``) so that mypy checks every reader.

Each class is named after the event it answers: :class:`PushReply` (``Push``),
:class:`PullReply` (``Pull``), :class:`ConfirmedReply` (``Confirmed``, and ``Flush`` too: both
say what every copy holds), :class:`MarksReply` (``Marks``), :class:`VersionsReply`
(``Versions`` of the primaries), :class:`ReplicateReply` (``Replicate``: a backup's answer to a
forward), :class:`BeatReply` (the controller's answer to a ``Beat``) and :class:`ReportReply`
(its answer to a ``WriteReport``).

Over a wire (a Dask actor or scheduler call's return value, the data plane's msgpack headers)
a reply travels as the dict it always was, same keys (a cluster of mixed versions still talks):
``to_wire()`` makes it, ``from_wire()`` reads it back, in this module alone. A field that is
None is left out of the dict (an answer that never carried it). The simulation hands the
objects over as they are.

The commands' answers (fence, promote, add_backups: ``{sid: position or version}``; restore:
a version; assign, drop: None) and ``Versions`` of every shard held (``{sid: version}``) stay
plain values: a mapping of shard ids, nothing keyed by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .shard import Mark

__all__ = [
    "BeatReply",
    "ConfirmedReply",
    "MarksReply",
    "NodeReply",
    "PullReply",
    "PushReply",
    "ReplicateReply",
    "ReportReply",
    "VersionsReply",
    "reply_from_wire",
]

Position = tuple[int, int]


def _sids(xs: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(s) for s in xs)


def _ints(d: Mapping[Any, Any]) -> dict[int, int]:
    return {int(s): int(v) for s, v in d.items()}


def _opt_ints(d: Mapping[Any, Any] | None) -> dict[int, int] | None:
    return None if d is None else _ints(d)


@dataclass(frozen=True, slots=True)
class PushReply:
    """A primary's answer to a push: ``per_shard`` {sid: the version the push made}; ``moved``
    the shards it may not take (the pusher reads the routing again and sends them anew);
    ``confirmed`` {sid: version every copy holds}; ``durable`` {sid: version the checkpoint
    holds too}; ``gens`` {sid: the primary's generation}. ``pulled``: the shards whose values
    follow on the data plane (a push with a pull), ``pulled_versions`` {sid: the version read}
    (the pusher's next push names it: the server optimizer's staleness). None: not in the
    answer (a node that is not there answers ``moved`` alone)."""

    per_shard: dict[int, int]
    moved: tuple[int, ...] = ()
    confirmed: dict[int, int] | None = None
    durable: dict[int, int] | None = None
    gens: dict[int, int] | None = None
    pulled: tuple[int, ...] | None = None
    pulled_versions: dict[int, int] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"per_shard": dict(self.per_shard), "moved": list(self.moved)}
        if self.confirmed is not None:
            out["confirmed"] = dict(self.confirmed)
        if self.durable is not None:
            out["durable"] = dict(self.durable)
        if self.gens is not None:
            out["gens"] = dict(self.gens)
        if self.pulled is not None:
            out["pulled"] = list(self.pulled)
        if self.pulled_versions is not None:
            out["pulled_versions"] = dict(self.pulled_versions)
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PushReply:
        pulled = d.get("pulled")
        return cls(
            _ints(d.get("per_shard", {})),
            _sids(d.get("moved", ())),
            _opt_ints(d.get("confirmed")),
            _opt_ints(d.get("durable")),
            _opt_ints(d.get("gens")),
            None if pulled is None else _sids(pulled),
            _opt_ints(d.get("pulled_versions")),
        )


@dataclass(frozen=True, slots=True)
class ConfirmedReply:
    """What every copy holds of the primaries asked (``Confirmed``), or holds now of the
    versions a ``Flush`` waited for: ``per_shard`` {sid: version}, ``durable`` {sid: version
    the checkpoint holds too}, ``gens`` {sid: the primary's generation}, ``moved`` the shards
    not primary there."""

    per_shard: dict[int, int]
    durable: dict[int, int]
    gens: dict[int, int]
    moved: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "per_shard": dict(self.per_shard),
            "durable": dict(self.durable),
            "gens": dict(self.gens),
            "moved": list(self.moved),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ConfirmedReply:
        return cls(
            _ints(d.get("per_shard", {})),
            _ints(d.get("durable", {})),
            _ints(d.get("gens", {})),
            _sids(d.get("moved", ())),
        )


@dataclass(frozen=True, slots=True)
class PullReply:
    """The values of the primaries asked: ``per_shard`` {sid: values} (None on the client once
    they are written where the caller wants them), ``moved`` the shards not primary there,
    ``versions`` {sid: the version read} (the puller's next push names it: the staleness).

    On the data plane the values follow the header, which names the shards alone
    (:meth:`plane_header`, :meth:`from_plane`)."""

    per_shard: dict[int, np.ndarray | None]
    moved: tuple[int, ...] = ()
    versions: dict[int, int] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"per_shard": dict(self.per_shard), "moved": list(self.moved)}
        if self.versions is not None:
            out["versions"] = dict(self.versions)
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PullReply:
        per_shard = {
            int(s): None if v is None else np.asarray(v) for s, v in d["per_shard"].items()
        }
        return cls(per_shard, _sids(d.get("moved", ())), _opt_ints(d.get("versions")))

    def plane_header(self) -> dict[str, Any]:
        out: dict[str, Any] = {"per_shard": list(self.per_shard), "moved": list(self.moved)}
        if self.versions is not None:
            out["versions"] = dict(self.versions)
        return out

    @classmethod
    def from_plane(cls, d: Mapping[str, Any]) -> PullReply:
        return cls(
            dict.fromkeys(_sids(d["per_shard"])),
            _sids(d.get("moved", ())),
            _opt_ints(d.get("versions")),
        )


@dataclass(frozen=True, slots=True)
class MarksReply:
    """``per_shard`` {sid: {replica: the marks of its pushes of the epoch asked}}, ``moved``."""

    per_shard: dict[int, dict[int, tuple[Mark, ...]]]
    moved: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"per_shard": dict(self.per_shard), "moved": list(self.moved)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> MarksReply:
        per_shard = {
            int(s): {int(r): tuple(ms) for r, ms in m.items()} for s, m in d["per_shard"].items()
        }
        return cls(per_shard, _sids(d.get("moved", ())))


@dataclass(frozen=True, slots=True)
class VersionsReply:
    """``per_shard`` {sid: version} of the primaries asked, ``moved``."""

    per_shard: dict[int, int]
    moved: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"per_shard": dict(self.per_shard), "moved": list(self.moved)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> VersionsReply:
        return cls(_ints(d["per_shard"]), _sids(d.get("moved", ())))


NodeReply = PushReply | ConfirmedReply | PullReply | MarksReply | VersionsReply

_BY_OP: dict[str, Any] = {
    "push": PushReply,
    "pull": PullReply,
    "confirmed": ConfirmedReply,
    "flush": ConfirmedReply,
    "marks": MarksReply,
    "versions": VersionsReply,
}


def reply_from_wire(op: str, d: Mapping[str, Any]) -> NodeReply:
    """A node's answer to a client request ``op`` (a :class:`~.request.Request`'s), read from
    the dict it came as."""
    cls = _BY_OP.get(op)
    if cls is None:
        raise ValueError(f"no such request {op!r}")
    reply: NodeReply = cls.from_wire(d)
    return reply


@dataclass(frozen=True, slots=True)
class ReplicateReply:
    """A backup's answer to a forward: ``held`` {sid: the position it holds now}, ``refused``
    {sid: the generation it knows, newer than the one sent, or -1 when it does not hold the
    shard}."""

    held: dict[int, Position]
    refused: dict[int, int]

    def to_wire(self) -> dict[str, Any]:
        held = {int(s): (int(g), int(v)) for s, (g, v) in self.held.items()}
        return {"held": held, "refused": _ints(self.refused)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ReplicateReply:
        held = {int(s): (int(p[0]), int(p[1])) for s, p in d["held"].items()}
        return cls(held, _ints(d["refused"]))


@dataclass(frozen=True, slots=True)
class BeatReply:
    """The controller's answer to a heartbeat: whether the node still belongs to the server,
    and ``gens`` {sid: the current generation} of the shards it holds."""

    member: bool
    gens: dict[int, int]

    def to_wire(self) -> dict[str, Any]:
        return {"member": self.member, "gens": dict(self.gens)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> BeatReply:
        return cls(bool(d["member"]), _ints(d["gens"]))


@dataclass(frozen=True, slots=True)
class ReportReply:
    """The controller's answer to a write-back report: ``accepted`` {sid: version} (the
    manifest names the block), ``refused`` {sid: generation} (the writer's is stale; -2: the
    writer is no member)."""

    accepted: dict[int, int]
    refused: dict[int, int]

    def to_wire(self) -> dict[str, Any]:
        return {"accepted": dict(self.accepted), "refused": dict(self.refused)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ReportReply:
        return cls(_ints(d["accepted"]), _ints(d["refused"]))
