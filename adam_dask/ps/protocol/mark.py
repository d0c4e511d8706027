"""What one push covers of its pusher's data (:class:`Mark`): the data position a shard records
with the push, fences re-runs by, and, for a synchronous step's shares, groups into one round of
the server optimizer. Pure: a frozen value with its JSON form (the plane's headers, the copies'
forwards and the checkpoint's blocks carry it as :meth:`Mark.to_json`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Mark"]


@dataclass(frozen=True, slots=True)
class Mark:
    """What one push covers of its pusher's data: the data position a shard records with it.

    A pusher is a replica in an epoch (``epoch``, ``replica``, one of ``replicas``); its
    pushes are numbered (``seq``), and a push sent as ``parts`` calls (a delta, then the dense
    layers' outer products) numbers its calls (``part``); ``targets`` names the shards a part
    goes to (None: all). A shard applies a push only when it has not applied that ``(seq,
    part)`` of the pusher before (sequence fencing: a re-run that pushes the same numbers again
    is applied once per shard, a replay arriving after newer pushes still applies) and records
    the mark atomically with the values. ``covers`` (JSON-safe) is opaque to the parameter
    server: the data the push covers. ``synchronous``: the push is its replica's share of a
    synchronous step, whose pushes (same ``epoch`` and ``seq``, every replica) the server
    optimizer takes as one round (:mod:`adam_dask.ps.protocol.optimizer`).
    """

    epoch: int
    replica: int
    seq: int
    part: int
    parts: int
    replicas: int
    covers: Any
    targets: tuple[int, ...] | None = None
    synchronous: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.replica)

    @property
    def order(self) -> tuple[int, int]:
        return (self.seq, self.part)

    @property
    def round(self) -> tuple[int, int] | None:
        """The synchronous step the push belongs to (None: a push of its own)."""
        return (self.epoch, self.seq) if self.synchronous else None

    def to_json(self) -> list:
        targets = None if self.targets is None else list(self.targets)
        return [
            self.epoch,
            self.replica,
            self.seq,
            self.part,
            self.parts,
            self.replicas,
            self.covers,
            targets,
            self.synchronous,
        ]

    @classmethod
    def from_json(cls, doc: Any) -> Mark:
        e, r, seq, part, parts, replicas, covers, targets, *rest = doc  # 8: before synchronous
        t = None if targets is None else tuple(int(x) for x in targets)
        sync = bool(rest[0]) if rest else False
        return cls(int(e), int(r), int(seq), int(part), int(parts), int(replicas), covers, t, sync)
