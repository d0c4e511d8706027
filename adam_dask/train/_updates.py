"""Exact bookkeeping of a replica's updates: per-thread double buffers, taken and installed at
mini-batch boundaries.

The Hogwild threads of a replica add their updates to the shared weights ``flat`` without a
common lock. What leaves for the parameter server must nevertheless be exact: every update a
thread computed goes into exactly one push, and weights pulled from the server must not wipe out
an update that lands while they are installed. (The old design derived the delta as
``flat - snapshot`` and installed pulled weights as ``pulled + (flat - snapshot)`` from another
thread; an update landing between that read and the write was dropped.)

Here each thread owns a :class:`Slot`: a lock it holds for one mini-batch step, an *active*
accumulator that receives the same update as ``flat`` (the fused step's ``acc``, or
:func:`~adam_dask.model.fused.sgd_update_into`), the images and stream items it covers, and the
dense-layer terms of the offload. :meth:`Updates.take` swaps each slot's active buffer with its
zeroed spare under the slot's lock, so the cut between two takes falls on a mini-batch boundary
of every thread: the taken :class:`Update` holds whole mini-batches, each exactly once.
:meth:`Updates.install` sums ``pulled + the updates in transit + the updates not yet taken``
aside while the threads train on, and copies it over ``flat`` in one pass without stopping them:
a Hogwild write like their own. A step landing during that pass may be missed or counted twice
*in the local weights* (as two threads racing inside ``flat`` may lose one), never in what is
pushed: the accumulators are only ever written by their own thread and swapped under its lock,
so every update leaves in exactly one push and the next install rewrites the local weights from
the server's. An update taken *in transit*
(``take(in_transit=True)``: on its way to the server, which may not hold it yet when the next
weights are pulled) is added on top of every install too, until :meth:`Updates.landed` says the
server holds it: weights pulled while a queued update waits must not set the replica back by
that update. Two Hogwild threads racing inside ``flat`` may still lose one update locally (the
paper's lock-free write), but it is in its thread's accumulator, so it is pushed and comes back
with the next pull. (An earlier install held every slot's lock for its pass: each pull stopped
every thread until the slowest finished its mini-batch.)

A taker never starves behind a thread that re-takes its lock at once: it closes the slot's
gate first, and a thread waits at the gate before its next mini-batch.

No Dask, no I/O: tested directly (tests/train/test_updates.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.fused import sgd_update_into

__all__ = ["Slot", "Update", "Updates", "concat_terms", "summed"]


def summed(base: np.ndarray, weights: np.ndarray, addends: list[np.ndarray]) -> np.ndarray:
    """``base = weights + sum(addends)``, written into ``base`` (which may be ``weights``
    itself): an install's values, summed aside so that the replica's weights are then written
    in one pass (``np.copyto(flat, summed(...))``), a lock-free write like a Hogwild thread's,
    while the threads train on."""
    if addends:
        np.add(weights, addends[0], out=base)
        for a in addends[1:]:
            base += a
    elif base is not weights:
        np.copyto(base, weights)
    return base


@dataclass(slots=True)
class Update:
    """Whole mini-batches of updates, taken at once: what one push carries."""

    delta: np.ndarray
    """Flat float32: the sum of the updates (offloaded dense weights zeroed: they are terms)."""
    terms: dict[str, tuple[np.ndarray, np.ndarray]]
    """Offloaded layer prefix -> (activations (N, in), -lr * errors (N, out))."""
    images: int
    """Images whose updates the delta holds."""
    items: dict[Any, int]
    """Stream item (its draw number) -> images of it the delta holds (the data position)."""
    ticket: int | None = None
    """Set when taken in transit: :meth:`Updates.landed` takes it."""

    @property
    def empty(self) -> bool:
        return self.images == 0 and not self.terms


@dataclass(slots=True)
class Slot:
    """One training thread's share of the bookkeeping; every field is guarded by ``lock``."""

    lock: threading.Lock
    gate: threading.Event  # cleared while a taker waits for the lock
    acc: np.ndarray
    spare: np.ndarray
    images: int = 0
    items: dict[Any, int] = field(default_factory=dict)
    terms: list[dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)

    def record(
        self, images: int, item: Any, terms: dict[str, tuple[np.ndarray, np.ndarray]] | None
    ) -> None:
        """Count one mini-batch just added to ``acc`` (call with the lock held)."""
        self.images += images
        self.items[item] = self.items.get(item, 0) + images
        if terms:
            self.terms.append(terms)

    def _reset(self) -> None:
        self.images, self.items, self.terms = 0, {}, []


class Updates:
    """The per-thread accumulators of one replica (``threads`` slots over ``size`` parameters).

    ``offload``: ``{layer prefix: (offset, size)}`` of the dense weights that travel as terms.
    """

    def __init__(self, size: int, threads: int, offload: dict[str, tuple[int, int]] | None = None):
        self.size = int(size)
        self.offload = dict(offload or {})
        self._slots = [
            Slot(
                threading.Lock(),
                threading.Event(),
                np.zeros(self.size, np.float32),
                np.zeros(self.size, np.float32),
            )
            for _ in range(threads)
        ]
        for slot in self._slots:
            slot.gate.set()
        self._control = threading.Lock()  # one taker or installer at a time
        self._in_transit: dict[int, np.ndarray] = {}  # ticket -> the update's whole local sum
        self._tickets = 0
        self._base: np.ndarray | None = None  # install's scratch: pulled + in transit

    @contextmanager
    def hold(self, t: int) -> Iterator[Slot]:
        """Thread ``t``'s slot, locked for one mini-batch: add the update to ``slot.acc`` as
        well as to the weights, then :meth:`Slot.record` it."""
        slot = self._slots[t]
        slot.gate.wait()
        with slot.lock:
            yield slot

    def apply(
        self,
        t: int,
        flat: np.ndarray,
        grad: np.ndarray,
        velocity: np.ndarray,
        lr: float,
        momentum: float,
        images: int,
        item: int,
        terms: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        """Thread ``t``: add one mini-batch's gradient step (of ``images`` images of stream item
        ``item``) to ``flat`` and to its accumulator; ``terms`` are its offload terms."""
        with self.hold(t) as slot:
            sgd_update_into(flat, slot.acc, grad, velocity, lr, momentum)
            slot.record(images, item, terms)

    @contextmanager
    def _locked(self, slots: list[Slot]) -> Iterator[None]:
        for slot in slots:
            slot.gate.clear()
        held: list[Slot] = []
        try:
            for slot in slots:
                slot.lock.acquire()
                held.append(slot)
            yield
        finally:
            for slot in reversed(held):
                slot.lock.release()
            for slot in slots:
                slot.gate.set()

    def take(self, in_transit: bool = False, out: np.ndarray | None = None) -> Update:
        """Every update applied since the last take, and reset (whole mini-batches only).

        ``in_transit``: the update is on its way to the server; every :meth:`install` adds it
        on top of the weights it writes until :meth:`landed` (the server holds it). ``out``: a
        flat float32 array to write the delta into (the server's buffer: the sum of the threads'
        accumulators is written once, where the push reads it)."""
        retired: list[np.ndarray] = []
        items: dict[Any, int] = {}
        terms: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
        images = 0
        with self._control:
            for slot in self._slots:
                with self._locked([slot]):
                    slot.acc, slot.spare = slot.spare, slot.acc
                    retired.append(slot.spare)
                    images += slot.images
                    for k, n in slot.items.items():
                        items[k] = items.get(k, 0) + n
                    terms.extend(slot.terms)
                    slot._reset()
            delta = np.empty(self.size, np.float32) if out is None else out
            if len(retired) == 1:
                np.copyto(delta, retired[0])
            else:  # the sum written once
                np.add(retired[0], retired[1], out=delta)
                for buf in retired[2:]:
                    delta += buf
            for buf in retired:
                buf[...] = 0.0  # the next swap hands it out as an active accumulator
            ticket = None
            if in_transit and images:
                self._tickets += 1
                ticket = self._tickets
                # the local sum, offloaded weights included (the server applies their terms)
                self._in_transit[ticket] = delta
        if self.offload:
            if ticket is not None:
                delta = delta.copy()  # the pushed delta leaves the offloaded weights out
            for offset, size in self.offload.values():
                delta[offset : offset + size] = 0.0
        return Update(delta, concat_terms(terms, self.offload), images, items, ticket)

    def landed(self, update: Update) -> None:
        """The server holds ``update`` (or it was dropped): installs stop adding it."""
        if update.ticket is not None:
            with self._control:
                self._in_transit.pop(update.ticket, None)

    def pending(self) -> np.ndarray:
        """The sum of the updates not yet taken (a copy)."""
        out = np.zeros(self.size, np.float32)
        for slot in self._slots:
            with slot.lock:
                out += slot.acc
        return out

    def install(self, flat: np.ndarray, weights: np.ndarray, keep_pending: bool = True) -> None:
        """Write ``weights`` into ``flat`` plus the updates in transit and not yet taken
        (``keep_pending``): the threads train on meanwhile, never stopped (the values are summed
        aside and copied over ``flat`` in one pass, a Hogwild write like the threads' own). Or
        discard those (``keep_pending=False``): every thread stops for that one pass."""
        with self._control:  # one taker or installer at a time
            if not keep_pending:
                self._in_transit.clear()
                with self._locked(self._slots):
                    np.copyto(flat, weights)
                    for slot in self._slots:
                        slot.acc[...] = 0.0
                        slot._reset()
                return
            if self._base is None:
                self._base = np.empty(self.size, np.float32)
            addends = [slot.acc for slot in self._slots] + list(self._in_transit.values())
            np.copyto(flat, summed(self._base, weights, addends))


def concat_terms(
    terms: list[dict[str, tuple[np.ndarray, np.ndarray]]],
    offload: Mapping[str, Any],
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
