"""A partition's update and its exchange with the parameter server: its threads' accumulators,
a push group's take, the push (with the span read back) on a communicator thread, and the
install of what came back. No Dask; the runner (:mod:`._pipeline`) decides when a group is
complete and takes it.

Each training thread accumulates into one of two buffers by its group's parity (a group's
push holds exactly that group's mini-batches; at most two groups are open). A take sums the
group's buffers into one (thread 0's, a zeroed spare swapped in) and queues it; the
communicator pushes it as this partition's part of the group's push and installs the span read
back in the same round trip, plus what this partition applied and the server does not hold yet.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ClusterError, UpdateRejected
from ..ps.protocol.shard import Mark
from ._communicator import Communicator

if TYPE_CHECKING:
    from ..model.stage import Stage, WholeStage
    from ._handle import StagePushes

__all__ = ["StageExchange", "Taken", "concat_terms", "summed"]


@dataclass(frozen=True, slots=True)
class Taken:
    """A group's update taken for its push: the group's number, what it covers, its images and
    the buffer its update was summed into."""

    seq: int
    covers: list
    images: int
    buf: np.ndarray
    step: bool  # a synchronous step: pushed, then the barrier, then the pull
    terms: dict = field(default_factory=dict)  # the offload: prefix -> (activations, errors)


class StageExchange:
    """The update of ``stage`` (``part``: partition ``index`` of ``parts``) by ``threads``
    threads, and its pushes to ``server`` with ``mark`` = ``(epoch, replica, replicas)``.

    ``dropped()``: whether a taken group is to be dropped, not pushed (the replica failed or
    runs again); ``on_error(exc)``: a push failed (the partition stops); ``on_left()``: a taken
    group left (pushed or dropped).

    ``barrier`` (synchronous mode): blocks until every replica of the step has pushed and
    returns the :class:`~adam_dask.train.task.SyncBarrier`'s answer; a step's group is pushed
    at ``scale`` (``1/R``: the server applies the replicas' average), then the barrier, then
    the span is pulled and installed (a re-trained stretch is pushed alone, as a whole
    replica's).
    """

    def __init__(
        self,
        stage: Stage | WholeStage,
        server: StagePushes,
        *,
        part: tuple[int, int],
        threads: int,
        mark: tuple[int, int, int],
        dropped: Callable[[], bool],
        on_error: Callable[[BaseException], None],
        on_left: Callable[[], None],
        barrier: Callable[[], dict] | None = None,
        label: str = "the replica",
    ):
        self.stage, self.threads = stage, threads
        self.index, self.parts = part
        self.server, self.mark = server, mark
        self._dropped, self._on_left = dropped, on_left
        self.barrier, self.label = barrier, label
        self.scale = 1.0 / mark[2] if barrier is not None else 1.0
        n = stage.size
        # accumulators: one per thread and group parity, and whether each may hold updates
        # (an install adds only those)
        self._accs = [[np.zeros(n, np.float32) for _ in range(2)] for _ in range(threads)]
        self._touched = [[False, False] for _ in range(threads)]
        # zeroed buffers: a take swaps one in for thread 0's accumulator, which is pushed
        self._buffers: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(2):
            self._buffers.put(np.zeros(n, np.float32))
        self._pulled = np.zeros(n, np.float32)  # the span read back with each push
        self._unpushed: list[np.ndarray] = []
        # the offload (a whole model's dense layers, :class:`~adam_dask.model.stage.WholeStage`):
        # each thread's terms per group parity
        self.offload: dict[str, tuple[int, int]] = getattr(stage, "offload", {})
        self._terms: list[list[list[dict]]] = [[[], []] for _ in range(threads)]
        self._take_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.pushes = 0
        self.images_pushed = 0
        self.ps_seconds = 0.0
        self.groups_pushed: list[int] = []
        self._communicator: Communicator[Taken] = Communicator(
            self._send, name=f"partition-{self.index}-exchange", on_error=on_error, drop=self._drop
        )

    def acc(self, t: int, g: int) -> np.ndarray:
        """Thread ``t``'s accumulator for group ``g``, marked as holding updates."""
        self._touched[t][g % 2] = True
        return self._accs[t][g % 2]

    def record_terms(self, t: int, g: int, terms: dict) -> None:
        """Thread ``t``'s offload terms of a mini-batch of group ``g`` (with its update in
        :meth:`acc`)."""
        self._terms[t][g % 2].append(terms)

    def take(self, g: int, seq: int, covers: list, images: int, *, stretch: bool = False) -> None:
        """Group ``g`` (number ``seq``, covering ``covers``, ``images``; ``stretch``: a
        re-trained stretch) is complete here: its update summed into one buffer and queued
        for its push. No thread writes this parity's
        accumulators now: the group's mini-batches are all applied here, and group ``g + 2``
        starts after this one's errors left every partition."""
        spare = self._buffers.get()
        parity = g % 2
        with self._take_lock:  # not while an install reads the accumulators
            buf = self._accs[0][parity]
            self._accs[0][parity] = spare
            self._touched[0][parity] = False
            for t in range(1, self.threads):
                buf += self._accs[t][parity]
                self._accs[t][parity][...] = 0.0
                self._touched[t][parity] = False
            self._unpushed.append(buf)
            terms = [d for pair in self._terms for d in pair[parity]]
            for pair in self._terms:
                pair[parity] = []
        step = self.barrier is not None and not stretch
        taken = Taken(seq, covers, images, buf, step, concat_terms(terms, self.offload))
        self._communicator.put(taken)

    def close(self) -> None:
        """Push (or, after an error, drop) what was taken, then end the communicator."""
        self._communicator.close()

    def _forget_unpushed(self, buf: np.ndarray) -> None:
        """Take ``buf`` out of the unpushed buffers, by identity (``list.remove`` compares
        arrays with ``==``: elementwise, an error once another buffer comes first)."""
        for i, u in enumerate(self._unpushed):
            if u is buf:
                del self._unpushed[i]
                return

    def _send(self, taken: Taken) -> None:
        """Push a group's update as this partition's part of the group's push, with the span
        read back in the same round trip (a synchronous step: pulled after the barrier), and
        install it; nothing when ``dropped()``. ``ps_seconds`` leaves the barrier out."""
        if self._dropped():
            self._drop(taken)
            return
        try:
            t = time.perf_counter()
            buf = taken.buf
            if self.barrier is not None:
                buf *= np.float32(self.scale)  # in place: the exchange's own buffer
            # the span read back in the push's round trip, unless a step's pull must wait for
            # the barrier or the offloaded terms leave after the push
            back = not taken.step and not taken.terms
            try:  # the server checks every value (NaN/Inf refused, nothing applied)
                if taken.terms:
                    self._push_with_terms(taken)
                    pulled = None
                else:
                    mark = self._mark(taken, self.index, self.parts)
                    out = self._pulled if back else None
                    pulled = self.server.push_range(buf, self.stage.start, mark=mark, out=out)
            except UpdateRejected as exc:
                raise UpdateRejected(
                    f"{self.label} produced a non-finite update (the model diverged): "
                    f"{exc.message}",
                    "lower the learning rate (--lr) or push_every",
                    shard=exc.shard,
                ) from exc
            with self._take_lock:
                self._forget_unpushed(taken.buf)
            with self._count_lock:
                self.pushes += 1
                self.images_pushed += taken.images
                self.groups_pushed.append(taken.seq)
            if taken.step:  # every replica's push of the step lands before the pull
                t += self._wait_barrier()
            if not back:
                stop = self.stage.start + len(self._pulled)
                pulled = self.server.pull_range(self.stage.start, stop, out=self._pulled)
            assert pulled is not None
            self.ps_seconds += time.perf_counter() - t
            self.install(pulled)
        finally:
            self._recycle(taken.buf)

    def _mark(self, taken: Taken, part: int, parts: int) -> Mark:
        epoch, replica, replicas = self.mark
        sync = self.barrier is not None
        return Mark(
            epoch, replica, taken.seq, part, parts, replicas, taken.covers, synchronous=sync
        )

    def _push_with_terms(self, taken: Taken) -> None:
        """A whole model's push with the offload: the delta without the
        offloaded weights (part 0 of the push), then each offloaded layer's terms (the parts
        after it), whose products the parameter server computes and applies."""
        buf, prefixes = taken.buf, list(taken.terms)
        parts = 1 + len(prefixes)
        for offset, size in self.offload.values():
            buf[offset : offset + size] = 0.0  # they travel as terms
        self.server.push(buf, mark=self._mark(taken, 0, parts))
        for i, prefix in enumerate(prefixes, start=1):
            acts, errs = taken.terms[prefix]
            offset = self.offload[prefix][0]
            mark = self._mark(taken, i, parts)
            self.server.push_outer(offset, errs, acts, scale=self.scale, mark=mark)

    def _wait_barrier(self) -> float:
        """Wait at the synchronous step's barrier; the seconds waited. A step that timed out
        raises the error naming the replicas that never pushed."""
        assert self.barrier is not None
        t = time.perf_counter()
        answer = self.barrier()
        if not answer.get("ok"):
            missing = ", ".join(str(r) for r in answer.get("missing") or []) or "unknown"
            raise ClusterError(
                f"synchronous step {answer.get('generation')}: {self.label} waited "
                f"{answer.get('timeout')} s for replica(s) {missing}, which never pushed (their "
                "TRAIN worker is frozen, overloaded or lost)",
                "check those workers, raise adam.train.sync-timeout, or train with "
                "mode='async', which does not wait for stragglers",
            )
        return time.perf_counter() - t

    def _drop(self, taken: Taken) -> None:
        """A group's update is not pushed: forgotten, its buffer recycled."""
        with self._take_lock:
            self._forget_unpushed(taken.buf)
        self._recycle(taken.buf)

    def _recycle(self, buf: np.ndarray) -> None:
        """``buf`` zeroed back to the buffers a take swaps in: its group left."""
        buf[...] = 0.0
        self._buffers.put(buf)
        self._on_left()

    def install(self, pulled: np.ndarray) -> None:
        """The pulled span, plus what this partition applied and the server does not hold yet
        (groups taken but not pushed, the accumulators that hold updates), as its weights:
        summed into ``pulled`` aside (:func:`summed`, under the take
        lock, so that no group moves from an accumulator to the unpushed meanwhile), then
        copied over the weights in one pass. The threads train on meanwhile (Hogwild): an
        update landing during the copy may be lost locally, but it is in its accumulator,
        pushed, and back with the next pull."""
        with self._take_lock:
            addends = list(self._unpushed)
            for t, pair in enumerate(self._accs):
                addends += [acc for p, acc in enumerate(pair) if self._touched[t][p]]
            summed(pulled, pulled, addends)
        np.copyto(self.stage.flat, pulled)


def summed(base: np.ndarray, weights: np.ndarray, addends: list[np.ndarray]) -> np.ndarray:
    """``base = weights + sum(addends)``, written into ``base`` (which may be ``weights``
    itself): an install's values, summed aside so that the stage's weights are then written
    in one pass, a lock-free write like a Hogwild thread's, while the threads train on."""
    if addends:
        np.add(weights, addends[0], out=base)
        for a in addends[1:]:
            base += a
    elif base is not weights:
        np.copyto(base, weights)
    return base


def concat_terms(
    terms: list[dict[str, tuple[np.ndarray, np.ndarray]]], offload: Mapping[str, Any]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The offload terms of several mini-batches (each ``{prefix: (activations, errors)}``),
    each layer's stacked into one pair (in ``offload``'s order)."""
    out = {}
    for prefix in offload:
        parts = [t[prefix] for t in terms if prefix in t]
        if parts:
            out[prefix] = (
                np.concatenate([a for a, _ in parts]),
                np.concatenate([e for _, e in parts]),
            )
    return out
