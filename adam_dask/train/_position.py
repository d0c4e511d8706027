"""A replica's data position: which images of its share the parameter server applied.

A replica's share of an epoch is a fixed set of stream batches, each named ``(p, k)`` (batch
``k`` of partition ``p``, the same in every run of the share, with the same images in the same
order). One training thread steps through a batch's mini-batches in order, so each push covers a
range ``[a, b)`` of images of each batch it touches. Every push carries a
:class:`~adam_dask.ps.protocol.shard.Mark`: its number (``seq``; ``part`` numbers the calls of one push)
and what it ``covers`` (``[[p, k, a, b], ...]``). Each shard records the marks of the pushes it
applied, atomically with its values, and skips a push whose ``(seq, part)`` it applied already.

A re-run of the replica (its TRAIN worker died, or the whole cluster was lost and the run
resumed) reads every shard's marks and plans (:func:`resume_plan`). Shards may disagree: a push
in flight when the pusher died reached some of them. Each push some shard misses is re-trained
alone, as a *stretch* of exactly its images, and pushed under its number: the shards that hold
it skip it, the others apply it. Images no shard holds before the last one a push covered
(a push lost everywhere) are re-trained as stretches under new numbers; then the rest of the
share, from the position every batch has reached, under the following numbers. Every image's
update is applied once by every shard.

Pure: no Dask, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import ClusterError
from ..ps.protocol.shard import Mark

__all__ = [
    "Key",
    "Marker",
    "Plan",
    "Stretch",
    "applied_images",
    "cover_images",
    "decode",
    "encode",
    "recorded_replicas",
    "replica_plan",
    "resume_plan",
]

logger = logging.getLogger(__name__)

Key = tuple[int, int]  # (partition, batch number)
Ranges = dict[Key, tuple[int, int]]  # (p, k) -> images [first, stop) of that batch


def encode(ranges: Mapping[Key, tuple[int, int]]) -> list:
    """Ranges as JSON: ``[[p, k, first, stop], ...]``."""
    return [[int(p), int(k), int(a), int(b)] for (p, k), (a, b) in sorted(ranges.items()) if b > a]


def decode(doc: Sequence) -> Ranges:
    """The ranges of :func:`encode`'s JSON."""
    return {(int(p), int(k)): (int(a), int(b)) for p, k, a, b in doc or ()}


def cover_images(doc: Sequence) -> int:
    """Images in encoded ranges."""
    return sum(int(b) - int(a) for _, _, a, b in doc or ())


@dataclass(frozen=True, slots=True)
class Stretch:
    """A stretch of the share: images to re-train and push alone as push number ``seq``
    (``items``: the ranges of each batch it covers)."""

    seq: int
    items: Ranges

    @property
    def images(self) -> int:
        return sum(b - a for a, b in self.items.values())


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a (re-)run of a replica starts: the stretches to re-train first, then the rest of
    the share from ``position`` ({(p, k): images of it done}) with push numbers from
    ``next_seq``."""

    stretches: tuple[Stretch, ...] = ()
    position: dict[Key, int] = field(default_factory=dict)
    next_seq: int = 0
    replicas: int | None = None  # the replica count the positions were recorded with

    @property
    def resumed(self) -> bool:
        return self.next_seq > 0

    @property
    def images_done(self) -> int:
        """Images of the share done once the stretches are (held by some shard, or a stretch)."""
        return sum(self.position.values())


def _holes(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The gaps in ``ranges`` between 0 and their end."""
    out, at = [], 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out


def _targets(mark: Mark, sids: set[int]) -> set[int]:
    return sids if mark.targets is None else set(mark.targets)


def resume_plan(shards: Mapping[int, Sequence[Mark]]) -> Plan:
    """The plan of a replica's run from the marks of its pushes on every shard ({sid:
    marks}, every shard of the server, an empty sequence for a shard that holds none)."""
    sids = set(shards)
    parts: dict[int, dict[int, tuple[Mark, set[int]]]] = {}  # seq -> part -> (mark, holders)
    for sid, marks in shards.items():
        for m in marks:
            parts.setdefault(m.seq, {}).setdefault(m.part, (m, set()))[1].add(sid)
    if not parts:
        return Plan()
    replicas = {m.replicas for per in parts.values() for m, _ in per.values()}
    if len(replicas) != 1:
        m = next(iter(next(iter(parts.values())).values()))[0]
        raise ClusterError(
            f"replica {m.replica} of epoch {m.epoch} has positions recorded with different "
            f"replica counts {sorted(replicas)}",
            "resume the epoch with its replica count, or start the epoch again",
        )
    stretches = []
    covered: dict[Key, list[tuple[int, int]]] = {}
    for seq in sorted(parts):
        per = parts[seq]
        first = next(iter(per.values()))[0]
        ranges = decode(first.covers)
        for key, r in ranges.items():
            covered.setdefault(key, []).append(r)
        complete = all(
            j in per and _targets(per[j][0], sids) <= per[j][1] for j in range(first.parts)
        )
        if not complete:  # some shard misses (a part of) it: re-trained, pushed under seq
            stretches.append(Stretch(seq, ranges))
    next_seq = max(parts) + 1
    holes = {key: _holes(r) for key, r in covered.items()}
    while any(holes.values()):  # images of pushes lost on every shard: new numbers
        stretches.append(Stretch(next_seq, {key: h.pop(0) for key, h in holes.items() if h}))
        next_seq += 1
    position = {key: max(b for _, b in r) for key, r in covered.items()}
    return Plan(tuple(stretches), position, next_seq, replicas.pop())


def replica_plan(
    marks: Mapping[int, Mapping[int, Sequence[Mark]]], epoch: int, replica: int, replicas: int
) -> Plan:
    """The plan of replica ``replica`` of ``replicas`` in ``epoch`` from every shard's marks of
    the epoch ({sid: {replica: marks}}, :meth:`ParameterServer.marks`): where a run of it
    starts, whether it runs whole or as partitions. Raises :class:`ClusterError` when the
    marks were recorded with another replica count (the shares differ)."""
    plan = resume_plan({sid: per.get(replica, ()) for sid, per in marks.items()})
    if plan.replicas is not None and plan.replicas != replicas:
        raise ClusterError(
            f"replica {replica} of epoch {epoch} runs as one of {replicas}, but its data "
            f"position was recorded as one of {plan.replicas}",
            f"resume the epoch with {plan.replicas} replicas",
        )
    if plan.resumed:
        logger.info(
            "replica %d of epoch %d resumes at %d images, of which %d in %d stretch(es) to "
            "re-train for some shards; next push %d",
            replica,
            epoch,
            plan.images_done,
            sum(stretch.images for stretch in plan.stretches),
            len(plan.stretches),
            plan.next_seq,
        )
    return plan


def applied_images(marks: Mapping[int, Mapping[int, Sequence[Mark]]]) -> int:
    """Images of an epoch whose updates the parameter server applied, from each shard's marks
    ({sid: {replica: marks}}): per replica, the images of its pushes on the shard that applied
    the fewest (after a flush every shard holds every push); for a partitioned replica (ranged
    pushes, whose marks name their target shards), the images of its complete pushes."""
    replicas = {r for per in marks.values() for r in per}
    total = 0
    for r in replicas:
        mine = {sid: per.get(r, ()) for sid, per in marks.items()}
        if any(m.part == 0 and m.targets is not None for ms in mine.values() for m in ms):
            total += _complete_images(mine)  # a partitioned replica's ranged pushes
            continue
        total += min(
            sum(cover_images(m.covers) for m in per.get(r, ()) if m.part == 0)
            for per in marks.values()
        )
    return total


def _complete_images(shards: Mapping[int, Sequence[Mark]]) -> int:
    """Images of a replica's pushes that are complete: every part (one per partition of a
    partitioned replica) held by every shard it targets. A partition's part alone does not
    apply an image: the image's update is every partition's."""
    sids = set(shards)
    parts: dict[int, dict[int, tuple[Mark, set[int]]]] = {}
    for sid, ms in shards.items():
        for m in ms:
            parts.setdefault(m.seq, {}).setdefault(m.part, (m, set()))[1].add(sid)
    total = 0
    for per in parts.values():
        first = next(iter(per.values()))[0]
        if all(j in per and _targets(per[j][0], sids) <= per[j][1] for j in range(first.parts)):
            total += cover_images(first.covers)
    return total


def recorded_replicas(marks: Mapping[int, Mapping[int, Sequence[Mark]]]) -> int | None:
    """The replica count an epoch's positions were recorded with (None: no position yet)."""
    counts = {m.replicas for per in marks.values() for ms in per.values() for m in ms}
    if len(counts) > 1:
        raise ClusterError(
            f"an epoch's data positions name different replica counts {sorted(counts)}",
            "start the epoch again",
        )
    return counts.pop() if counts else None


class Marker:
    """The marks of one replica's pushes in one epoch, numbered and placed from a
    :class:`Plan`: a push of the rest of the share covers, in each batch, the images after
    those pushed before."""

    def __init__(
        self,
        epoch: int,
        replica: int,
        replicas: int,
        plan: Plan | None = None,
        *,
        synchronous: bool = False,
    ):
        plan = plan or Plan()
        self.epoch, self.replica, self.replicas = int(epoch), int(replica), int(replicas)
        self.synchronous = bool(synchronous)  # each push is a share of a synchronous step
        self.position: dict[Key, int] = dict(plan.position)
        self.seq = plan.next_seq

    def marks(
        self, items: Mapping[Key, int], parts: int, stretch: Stretch | None = None
    ) -> list[Mark]:
        """The marks of the next push (``parts`` calls) of ``items`` {(p, k): images}: of
        ``stretch`` when given (its number and images), else of the rest of the share."""
        if stretch is not None:
            if {k: b - a for k, (a, b) in stretch.items.items()} != dict(items):
                raise ClusterError(
                    f"the re-trained stretch {stretch.seq} of replica {self.replica} in epoch "
                    f"{self.epoch} covers other images than recorded (the data changed?)",
                    "start the epoch again",
                )
            seq, ranges = stretch.seq, stretch.items
        else:
            seq = self.seq
            ranges = {
                k: (self.position.get(k, 0), self.position.get(k, 0) + n) for k, n in items.items()
            }
        covers = encode(ranges)
        return [
            Mark(
                self.epoch,
                self.replica,
                seq,
                part,
                parts,
                self.replicas,
                covers,
                synchronous=self.synchronous,
            )
            for part in range(parts)
        ]

    def commit(self, mark: Mark) -> None:
        """The push marked ``mark`` (of the rest of the share) was applied."""
        if mark.seq == self.seq:
            for key, (_, b) in decode(mark.covers).items():
                self.position[key] = b
            self.seq += 1
