"""The pure logic of one parameter-server shard: no Dask, no I/O, no clocks.

A :class:`ShardState` holds the values of one contiguous slice ``[start, stop)`` of the flat
parameter buffer, a version (the number of updates applied, monotonically increasing), the
generation of the primary that produced them (copies compare ``(generation, version)``: after a
fail-over the new primary's values win over an older primary's, even at a lower version), and a
bounded window of the ids of the last pushes applied, so that a push retried after a fail-over
is applied once. Everything here is synchronous and deterministic; the actor in
:mod:`adam_dask.ps.runtime.node` owns the I/O around it.

Shapes: ``n`` = floats in the shard; the dense offload's outer-product update is
:mod:`adam_dask.ps.protocol.outer`'s.

The apply loops are the numba kernels of :mod:`adam_dask.ps.shard_kernels`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ... import config
from ...errors import UpdateRejected
from .mark import Mark
from .optimizer import ServerOptimizer, staleness_scale
from .outer import outer_delta, outer_part
from .shard_kernels import first_nonfinite

logger = logging.getLogger(__name__)

__all__ = [
    "Mark",
    "ShardCopy",
    "ShardState",
]


# -- value objects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardCopy:
    """A copy of a shard's values at ``(gen, version)``, with push ids applied up to it:
    those after a base version, or all the shard remembers when ``full``."""

    shard: int
    start: int
    stop: int
    version: int
    values: np.ndarray
    ids: tuple[tuple[int, int], ...] = ()  # (version, push_id) pairs newer than a base version
    gen: int = 0
    full: bool = True
    marks: tuple[Mark, ...] = ()  # the data positions the values hold (all of them)
    state: np.ndarray | None = None  # the server optimizer's state at the version (momentum)
    base: int = -1  # not ``full``: the version the push ids start after

    def gap(self, held: tuple[int, int]) -> bool:
        """Whether a copy at ``held`` (gen, version) that took this one would miss push ids:
        it names those after ``base`` alone, and the copy is of another lineage or behind it
        (a primary whose record of this backup is stale: an answer of the node the backup's
        worker hosted before)."""
        return not self.full and (held[0] != self.gen or held[1] < self.base)

    def payloads(self) -> tuple[np.ndarray, ...]:
        """The arrays that travel and are stored: the values, then the optimizer's state."""
        return (self.values,) if self.state is None else (self.values, self.state)


# -- the shard -----------------------------------------------------------------------------------


class ShardState:
    """Values, version and recent push ids of one shard ``[start, stop)`` of the flat buffer.

    Parameters
    ----------
    shard : int
        The shard id.
    start, stop : int
        The slice of the flat buffer this shard holds.
    values : array, optional
        Initial values (copied); zeros by default.
    version : int
        The version of ``values``.
    dedup_window : int, optional
        How many recent push ids to remember for exactly-once retries (``adam.ps.dedup-window``).
    gen : int
        The generation of the primary that produced ``values``.
    mark_epochs : int, optional
        The newest epochs whose data positions (:class:`Mark`) the shard keeps
        (``adam.ps.mark-epochs``).
    optimizer : ServerOptimizer, optional
        What each push does to the values (:mod:`adam_dask.ps.protocol.optimizer`); the sum by
        default. Its state (``self.state``, the momentum) is the shard's as much as the values:
        copied, written back and installed with them.
    """

    def __init__(
        self,
        shard: int,
        start: int,
        stop: int,
        values: np.ndarray | None = None,
        version: int = 0,
        dedup_window: int | None = None,
        gen: int = 0,
        mark_epochs: int | None = None,
        optimizer: ServerOptimizer | None = None,
    ):
        self.shard, self.start, self.stop = int(shard), int(start), int(stop)
        n = self.stop - self.start
        if values is None:
            self.values = np.zeros(n, dtype=np.float32)
        else:
            self.values = np.array(values, dtype=np.float32, copy=True).reshape(-1)
            if self.values.shape[0] != n:
                raise UpdateRejected(
                    f"shard {shard} holds {n} floats, got {self.values.shape[0]}", shard=shard
                )
        self.version = int(version)
        self.gen = int(gen)
        self.optimizer = optimizer if optimizer is not None else ServerOptimizer()
        self.state = self.optimizer.new_state(n)
        self.dedup_window = int(config.get("ps.dedup-window", dedup_window))
        self._ids: OrderedDict[int, int] = OrderedDict()  # push_id -> version, oldest first
        self.mark_epochs = int(config.get("ps.mark-epochs", mark_epochs))
        # (epoch, replica) -> {(seq, part): mark} of the pushes applied
        self.marks: dict[tuple[int, int], dict[tuple[int, int], Mark]] = {}
        self._rounds: set[tuple[int, int]] = set()  # the synchronous steps of the marks
        self.pushes_applied = 0
        self.pushes_fenced = 0

    def __repr__(self) -> str:
        return (
            f"ShardState(shard={self.shard}, [{self.start}, {self.stop}), "
            f"gen={self.gen}, version={self.version})"
        )

    @property
    def size(self) -> int:
        return self.stop - self.start

    # -- checks ----------------------------------------------------------------------------------

    def check(self, delta: np.ndarray | None, scan: bool = True) -> np.ndarray | None:
        """``delta`` as a 1-D float32 array of the shard's length; :class:`UpdateRejected` if it
        has the wrong length or (``scan``) holds NaN/Inf. ``None`` is a delta of zeros (nothing
        to add). ``scan=False``: the pusher scanned the values already (the data plane)."""
        if delta is None:
            return None
        d = np.asarray(delta)
        if d.dtype != np.float32:
            d = d.astype(np.float32)
        d = d.reshape(-1)
        if d.shape[0] != self.size:
            raise UpdateRejected(
                f"shard {self.shard} holds {self.size} floats, the delta has {d.shape[0]}",
                "push a delta of the server's size",
                shard=self.shard,
            )
        bad = first_nonfinite(d) if scan else -1
        if bad >= 0:
            raise UpdateRejected(
                f"non-finite update to shard {self.shard} at flat index {self.start + bad} "
                f"({d[bad]}); the shard is unchanged",
                "check the gradients for overflow (lower the learning rate)",
                shard=self.shard,
            )
        return d

    def seen(self, push_id: int | None) -> bool:
        """Whether the push ``push_id`` was applied already (a retried push)."""
        return push_id is not None and push_id in self._ids

    def fenced(self, mark: Mark | None) -> bool:
        """Whether the push marked ``mark`` was applied already (by this run of its pusher or an
        earlier one)."""
        if mark is None:
            return False
        return mark.order in self.marks.get(mark.key, {})

    def _record(self, mark: Mark) -> None:
        self.marks.setdefault(mark.key, {})[mark.order] = mark
        if mark.round is not None:
            self._rounds.add(mark.round)
        newest = max(e for e, _ in self.marks)
        old = [k for k in self.marks if k[0] <= newest - self.mark_epochs]
        for key in old:
            del self.marks[key]
        if old:
            self._index_rounds()

    def joins_round(self, mark: Mark | None) -> bool:
        """Whether the push marked ``mark`` joins a synchronous round that a push applied here
        opened (any replica's, any part): the optimizer takes the round as one step."""
        return mark is not None and mark.round is not None and mark.round in self._rounds

    def marks_of(self, epoch: int) -> dict[int, tuple[Mark, ...]]:
        """{replica: the marks of its pushes applied here} of ``epoch``."""
        return {r: tuple(log.values()) for (e, r), log in self.marks.items() if e == epoch}

    def all_marks(self) -> tuple[Mark, ...]:
        return tuple(m for log in self.marks.values() for m in log.values())

    def set_marks(self, marks: Iterable[Mark]) -> None:
        """Replace the recorded marks (a copy's, or a checkpoint block's)."""
        self.marks = {}
        for m in marks:
            self.marks.setdefault(m.key, {})[m.order] = m
        self._index_rounds()

    def _index_rounds(self) -> None:
        """The synchronous steps of the recorded marks (derived from them, kept for lookups)."""
        self._rounds = {m.round for m in self.all_marks() if m.round is not None}

    # -- updates ---------------------------------------------------------------------------------

    def apply(
        self,
        delta: np.ndarray,
        push_id: int | None = None,
        mark: Mark | None = None,
        base: int | None = None,
    ) -> int:
        """Check and add one delta; returns the new version (the old one for a repeated id or
        a fenced mark)."""
        return self.apply_batch([delta], [push_id], [mark], bases=[base])[0]

    def apply_batch(
        self,
        deltas: Sequence[np.ndarray | None],
        push_ids: Sequence[int | None] | None = None,
        marks: Sequence[Mark | None] | None = None,
        checked: bool = False,
        bases: Sequence[int | None] | None = None,
    ) -> list[int]:
        """Check every delta, then apply them all in order through the shard's optimizer (the
        sum: added, blocked); returns each push's version. ``checked``: the caller checked them
        (:meth:`check`) already. ``bases``: the version of this shard each pusher last read
        (None: not known), for the optimizer's staleness.

        A batch with any bad delta is refused as a whole (:class:`UpdateRejected`), the shard
        unchanged. Pushes whose id was applied before are skipped and get the version at which
        they were applied; pushes whose mark is fenced (:meth:`fenced`) are skipped and get the
        current version. The mark of an applied push is recorded with it.
        """
        push_ids = list(push_ids) if push_ids is not None else [None] * len(deltas)
        marks = list(marks) if marks is not None else [None] * len(deltas)
        bases = list(bases) if bases is not None else [None] * len(deltas)
        checked_ = list(deltas) if checked else [self.check(d) for d in deltas]
        todo: list[np.ndarray] = []
        scales: list[float] = []
        joins: list[bool] = []
        versions: list[int] = []
        v = self.version
        for d, pid, mark, base in zip(checked_, push_ids, marks, bases):
            if pid is not None and pid in self._ids:
                versions.append(self._ids[pid])
                continue
            if self.fenced(mark):
                self.pushes_fenced += 1
                versions.append(v)
                continue
            join = self.joins_round(mark)
            if mark is not None:
                self._record(mark)
            v += 1
            versions.append(v)
            if d is not None:  # None: a delta of zeros, recorded but nothing to add
                todo.append(d)
                # a synchronous round's pushes all read the round's start: none is stale
                in_round = mark is not None and mark.synchronous
                stale = None if base is None or in_round else v - 1 - base
                scales.append(staleness_scale(stale))
                joins.append(join)
            if pid is not None:
                self._ids[pid] = v
        self.optimizer.apply(self.values, self.state, todo, scales, joins)
        self.pushes_applied += v - self.version
        self.version = v
        self._trim_ids()
        return versions

    def apply_outer(
        self,
        offset: int,
        out: int,
        inp: int,
        errors: np.ndarray,
        activations: np.ndarray,
        scale: float = 1.0,
        push_id: int | None = None,
        mark: Mark | None = None,
    ) -> int:
        """Add this shard's part of ``scale * errors.T @ activations`` (see the module doc)."""
        return self.apply(
            self.outer_as_delta(offset, out, inp, errors, activations, scale), push_id, mark
        )

    def outer_as_delta(
        self,
        offset: int,
        out: int,
        inp: int,
        errors: np.ndarray,
        activations: np.ndarray,
        scale: float = 1.0,
    ) -> np.ndarray:
        """This shard's full-length delta for an outer-product update (zeros outside it).

        ``errors`` is ``(B, out)``, or only the columns of the rows that touch this shard
        (``outer_part(...).row0 : row1``), which is what the client sends.
        """
        errors = np.asarray(errors, dtype=np.float32)
        activations = np.asarray(activations, dtype=np.float32)
        if (
            errors.ndim != 2
            or activations.ndim != 2
            or errors.shape[0] != activations.shape[0]
            or activations.shape[1] != inp
        ):
            raise UpdateRejected(
                f"push_outer needs errors (B, out) and activations (B, {inp}), "
                f"got {errors.shape} and {activations.shape}",
                shard=self.shard,
            )
        for name, a in (("errors", errors), ("activations", activations)):
            if first_nonfinite(a) >= 0:
                raise UpdateRejected(
                    f"non-finite {name} in an outer-product update to shard "
                    f"{self.shard}; the shard is unchanged",
                    shard=self.shard,
                )
        if not np.isfinite(scale):
            raise UpdateRejected(f"non-finite scale {scale}", shard=self.shard)
        delta = np.zeros(self.size, dtype=np.float32)
        part = outer_part(offset, out, inp, self.start, self.stop)
        if part is None:
            return delta
        if errors.shape[1] not in (out, part.row1 - part.row0):
            raise UpdateRejected(
                f"shard {self.shard} needs error columns {part.row0}:{part.row1} "
                f"of {out}, got {errors.shape[1]}",
                shard=self.shard,
            )
        delta[part.lo - self.start : part.hi - self.start] = outer_delta(
            part, offset, inp, errors, activations, scale
        )
        return delta

    def _trim_ids(self) -> None:
        while len(self._ids) > self.dedup_window:
            self._ids.popitem(last=False)

    # -- replication -----------------------------------------------------------------------------

    def ids_since(self, version: int) -> tuple[tuple[int, int], ...]:
        """The (version, push_id) pairs applied after ``version`` (all remembered when older
        than the window)."""
        out = []
        for pid, v in reversed(self._ids.items()):
            if v <= version:
                break
            out.append((v, pid))
        out.reverse()
        return tuple(out)

    @property
    def position(self) -> tuple[int, int]:
        """``(gen, version)``: how copies of a shard are ordered."""
        return (self.gen, self.version)

    def ids(self) -> dict[int, int]:
        """{push_id: version} of the remembered pushes (a copy)."""
        return dict(self._ids)

    def snapshot(self, since: int = -1, values: np.ndarray | None = None) -> ShardCopy:
        """A copy of the values at the current version (``values`` when the caller holds one
        already), with the push ids after ``since`` (all of them when ``since < 0``)."""
        return ShardCopy(
            self.shard,
            self.start,
            self.stop,
            self.version,
            self.values.copy() if values is None else values,
            self.ids_since(since),
            self.gen,
            since < 0,
            self.all_marks(),
            None if self.state is None else self.state.copy(),
            max(since, -1),
        )

    def install(
        self,
        version: int,
        values: np.ndarray,
        ids: Iterable[tuple[int, int]] = (),
        gen: int | None = None,
        full: bool = False,
        marks: Iterable[Mark] = (),
        state: np.ndarray | None = None,
    ) -> bool:
        """Take a newer copy (a backup's catch-up, or values read back from the checkpoint);
        False if ``(gen, version)`` is not newer than the copy held.

        A copy of the same generation adds ``ids`` to the remembered ones; a copy from another
        generation (another primary's lineage), or a ``full`` one, replaces them: ids of pushes
        whose effect the new values do not hold must not be remembered. ``marks`` (the data
        positions the values hold, all of them) replace the recorded ones. ``state``: the
        optimizer's state at that version (zeros when the copy has none and this shard keeps
        some: a checkpoint written before the optimizer was on).
        """
        version = int(version)
        gen = self.gen if gen is None else int(gen)
        if (gen, version) <= (self.gen, self.version):
            return False
        v = np.asarray(values, dtype=np.float32).reshape(-1)
        if v.shape[0] != self.size:
            raise UpdateRejected(
                f"shard {self.shard}: a copy of {v.shape[0]} floats, expected {self.size}",
                shard=self.shard,
            )
        self.values[:] = v
        self.set_state(state)
        if full or gen != self.gen:
            self._ids.clear()
        self.version = version
        self.gen = gen
        for ver, pid in ids:
            self._ids[int(pid)] = int(ver)
        self._trim_ids()
        self.set_marks(marks)
        return True

    def set_state(self, state: np.ndarray | None) -> None:
        """Take the optimizer's state of a copy (a copy's own: a backup promoted later continues
        from it); zeros when the copy has none."""
        if state is None:
            if self.state is not None:
                self.state[:] = 0.0
            return
        st = np.asarray(state, dtype=np.float32).reshape(-1)
        if st.shape[0] != self.size:
            raise UpdateRejected(
                f"shard {self.shard}: optimizer state of {st.shape[0]} floats, "
                f"expected {self.size}",
                shard=self.shard,
            )
        if self.state is None:  # a copy of a shard with momentum: keep it with the values
            self.state = st.copy()
        else:
            self.state[:] = st
