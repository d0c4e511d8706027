"""Replica placement: a replica task queued behind another on one TRAIN worker moves to a TRAIN
worker with a free slot.

Dask places a task that needs ``TRAIN=1`` on any worker that *supplies* that much, not one
where it is free. A replica re-run after its worker was lost (an eviction, a crash) so often
lands beside a running replica and waits there for the whole of it, while the replacement
worker that joins a moment later stays idle: the epoch's rest runs one replica at a time.
Dask's work stealing would move it but never does (a replica secedes at once, so its measured
duration is ~0).

:func:`plan_moves` (pure) says which queued tasks go where; :class:`ReplicaPlacement`, a
scheduler plugin registered by the Trainer, runs it when a TRAIN worker joins and when a task
needing TRAIN is placed, and carries each move out through the work-stealing extension's
request/confirm exchange, which moves a task only if its worker has not started it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from ..cluster import TRAIN

__all__ = ["PLUGIN_NAME", "ReplicaPlacement", "Slots", "plan_moves"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "adam-replica-placement"


@dataclass
class Slots:
    """A TRAIN worker as placement sees it: the TRAIN it supplies, the TRAIN held by the tasks
    it runs, and the tasks placed on it that it has not started ((key, TRAIN needed), oldest
    first)."""

    supply: float
    held: float = 0.0
    queued: list[tuple[str, float]] = field(default_factory=list)

    @property
    def free(self) -> float:
        return self.supply - self.held


def plan_moves(workers: dict[str, Slots]) -> list[tuple[str, str, str]]:
    """(key, from, to) for each queued task that cannot start where it is (its worker's free
    TRAIN is short of it) and fits where another worker's is not, those with nothing queued
    first and the most free first. Pure; ``workers`` is not changed."""
    free = {a: w.free for a, w in workers.items()}
    waiting = {a: list(w.queued) for a, w in workers.items()}
    moves: list[tuple[str, str, str]] = []
    for addr in sorted(workers):
        for key, need in workers[addr].queued:
            if free[addr] >= need:  # it starts here once the queue ahead of it does
                free[addr] -= need
                continue
            to = max(
                (a for a in workers if a != addr and free[a] >= need),
                key=lambda a: (not waiting[a], free[a], a),
                default=None,
            )
            if to is None:
                continue
            free[to] -= need
            moves.append((key, addr, to))
    return moves


class ReplicaPlacement(SchedulerPlugin):
    """The scheduler side of :func:`plan_moves` (see the module's doc)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self._due = False
        self.moved = 0

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None and ws.resources.get(TRAIN):
            self._soon()

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "processing" and self.scheduler is not None:
            ts = self.scheduler.tasks.get(key)
            if ts is not None and (ts.resource_restrictions or {}).get(TRAIN):
                self._soon()

    def _soon(self) -> None:
        # after the transitions under way: the placement they make is then complete
        if not self._due and self.scheduler is not None:
            self._due = True
            self.scheduler.loop.call_later(0.1, self._balance)

    def _slots(self) -> dict[str, Slots]:
        slots: dict[str, Slots] = {}
        for addr, ws in self.scheduler.workers.items():
            supply = ws.resources.get(TRAIN)
            if not supply or ws.status.name != "running":
                continue
            s = slots[addr] = Slots(float(supply))
            for ts in sorted(ws.processing, key=lambda t: t.priority or ()):
                need = float((ts.resource_restrictions or {}).get(TRAIN, 0))
                if not need:
                    continue
                if ts in ws.long_running:
                    s.held += need
                elif not (ts.worker_restrictions or ts.host_restrictions):
                    s.queued.append((ts.key, need))  # a pinned one (a partition's stage) stays
        return slots

    def _balance(self) -> None:
        self._due = False
        stealing = self.scheduler.extensions.get("stealing")
        if stealing is None:
            return  # work stealing switched off: no safe way to move a placed task
        again = False
        for key, victim, thief in plan_moves(self._slots()):
            ts = self.scheduler.tasks.get(key)
            if ts is None or ts.processing_on is None or ts.processing_on.address != victim:
                continue
            logger.info("replica task %s queued on %s moves to %s", key, victim, thief)
            stealing.move_task_request(
                ts, self.scheduler.workers[victim], self.scheduler.workers[thief]
            )
            self.moved += 1
            again = True
        if again and not self._due:
            # looked at again: a move the worker refused (the task had started, not seceded
            # yet) is planned anew with what it then runs
            self._due = True
            self.scheduler.loop.call_later(1.0, self._balance)
