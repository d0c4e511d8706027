"""A PS node's data-plane entry points, called from the plane's connection threads
(:mod:`adam_dask.ps.plane.server`), not the event loop: pushes applied in the calling thread by
flat combining, pulls read between two batches, forwards installed, what every copy holds. They
drive the same state machine as the actor, under the same lock; the actions they do not answer
at once (forwards, write-backs) go to the actor on its event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...errors import ShardUnavailable
from ..protocol.messages import Action, Confirmed, ForwardDue, Push, Pushes, Replicate, Reply
from ..protocol.node_machine import handle
from ..protocol.node_state import NodeState
from ..protocol.replies import ConfirmedReply, PushReply, ReplicateReply
from ..protocol.shard import ShardCopy
from .stimuli import stimulus, validating

__all__ = ["Answer", "NodePlane"]


class Answer:
    """The answer to one data-plane request (its request id in the state machine): set in the
    thread that applied it, or later on the event loop (``ack="all"`` waits for the forwards)."""

    __slots__ = ("done", "event", "value")

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.event = threading.Event()

    def set(self, value: Any) -> None:
        self.value, self.done = value, True
        self.event.set()


class NodePlane:
    """The data plane's way into one node (see the module doc). ``lock`` is the node's state
    lock; ``do`` carries actions out on the node's event loop; ``by_transport`` and
    ``counts`` are the node's counters (pushes and pulls served, the offload's products)."""

    def __init__(
        self,
        state: NodeState,
        lock: threading.RLock,
        worker: Any,
        cfg: dict,
        do: Callable[[list[Action]], None],
        counts: dict[str, int],
    ) -> None:
        self.state, self.lock, self.worker, self.cfg, self.do = state, lock, worker, cfg, do
        self.counts = counts
        self.pending_lock = threading.Lock()
        self.pending: list[tuple[Push, Answer]] = []
        self.validate = validating()  # adam.ps.validate: check the invariants each event

    def push(self, ev: Push, urgent: bool = False) -> PushReply:
        """A data-plane push (``ev``, its ``req`` None: the answer comes back here), applied in
        the calling thread.

        Flat combining: the push joins the pending ones; the thread that holds the state's lock
        applies every pending push as one batch (:class:`Pushes`, as the event loop batches
        actor calls) and hands each its answer, so a lone push costs no hop to the event loop
        and many at once are applied together. Other actions (forwards) go to the loop.
        ``urgent``: the pusher holds as many pushes as it may, forward to the backups now (its
        next answers then confirm them) instead of at the next ``forward-interval``. With
        ``ack="all"`` the answer comes once the backups hold the push (up to ``call_timeout``)."""
        state = self.state
        self.counts["plane"] += 1
        slot = Answer()
        with self.pending_lock:
            push = replace(ev, req=slot)
            self.pending.append((push, slot))
        with self.lock:
            rest = []
            if not slot.done:
                with self.pending_lock:
                    batch, self.pending = self.pending, []
                pushes = Pushes(
                    tuple(p for p, _ in batch),
                    stimulus_id=stimulus(f"push-{batch[0][0].push_id}"),
                )
                actions = handle(state, pushes, validate=self.validate)
                for a in actions:
                    if isinstance(a, Reply) and isinstance(a.req, Answer):
                        a.req.set(a.value)
                    else:
                        rest.append(a)
            if urgent:
                urgently = ForwardDue(stimulus_id=stimulus("urgent-forward"))
                rest += handle(state, urgently, validate=self.validate)
            if rest:
                self.worker.loop.asyncio_loop.call_soon_threadsafe(self.do, rest)
        if not slot.event.wait(float(self.cfg["call_timeout"])):
            raise ShardUnavailable(
                f"node {self.worker.address}: the backups did not take push {ev.push_id or 0:x} in "
                f"{self.cfg['call_timeout']}s (ack='all')",
                "check the PS workers",
            )
        if isinstance(slot.value, BaseException):
            raise slot.value
        reply: PushReply = slot.value
        return reply

    def outer(self, parts: dict, offset: int, out: int, inp: int, scale: float) -> dict:
        """The dense offload's update where it arrives: each shard's delta of ``scale *
        errors.T @ activations`` (``parts`` {sid: (error columns, activations)}), computed in
        the calling connection thread for the primaries here; the pusher sends it on with
        :meth:`push`. Shards not primary here are left out (the push reports them moved)."""
        state = self.state
        self.counts["outer_products"] += 1
        with self.lock:
            shards = {s: state.shards[s] for s in parts if s in state.primaries}
        return {
            s: st.outer_as_delta(offset, out, inp, parts[s][0], parts[s][1], scale)
            for s, st in shards.items()
        }

    def replicate(self, sender: str, snaps: tuple[ShardCopy, ...]) -> ReplicateReply:
        """A data-plane forward from the primary ``sender``, installed in the calling thread
        (the same :class:`Replicate` event as the actor's ``replicate``); other actions go to the loop."""
        reply: ReplicateReply = self._here(lambda req: [Replicate(req, sender, tuple(snaps))]).value
        return reply

    def read(
        self, sids: list[int], stamps: dict | None, dest: Any, versions: dict | None = None
    ) -> tuple:
        """A data-plane pull (:meth:`NodeState.read_into`), between two batches of pushes."""
        state = self.state
        self.counts["plane"] += 1
        with self.lock:
            return state.read_into(sids, stamps, dest, versions)

    def confirmed(self, sids: list[int], urgent: bool = False) -> ConfirmedReply:
        """What every copy (and the checkpoint) holds of the primaries among ``sids``, asked on
        the data plane; ``urgent``: forward to the backups now (a pusher waits for room)."""
        reply: ConfirmedReply = self._here(
            lambda req: (
                [Confirmed(req, tuple(int(s) for s in sids))]
                + ([ForwardDue(stimulus_id=stimulus("urgent-forward"))] if urgent else [])
            )
        ).value
        return reply

    def _here(self, events: Any) -> Answer:
        """Feed ``events(slot)`` in the calling thread (a data-plane connection's) under the
        state's lock; the reply to ``slot`` comes back here at once, other actions go to the
        event loop."""
        state = self.state
        slot = Answer()
        with self.lock:
            actions = [a for ev in events(slot) for a in handle(state, ev, validate=self.validate)]
        rest = []
        for a in actions:
            if isinstance(a, Reply) and a.req is slot:
                slot.set(a.value)
            else:
                rest.append(a)
        if rest:
            self.worker.loop.asyncio_loop.call_soon_threadsafe(self.do, rest)
        if not slot.done:  # pragma: no cover - these events are answered at once
            raise RuntimeError("a data-plane request was not answered")
        return slot
