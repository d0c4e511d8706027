"""One step of a capacity benchmark (``capacity.py``, ``data_capacity.py``): N emulated
replicas against a target, as threads in the TRAIN workers' processes, over a window of
``warmup`` unmeasured then ``seconds`` measured seconds, with where the cores went in it.

* :func:`run_step` (the client's side): the window, one Dask task per TRAIN worker (replica
  ``g`` of ``N`` on worker ``g % workers``), the CPU of the given processes and of the machine
  over the measured part, and the tasks' results with their errors (:class:`Step`);
* :func:`replica_threads` (the task's side): one thread per replica, each in a copy of the
  task's context;
* :func:`ms`: a latency for the steps' log lines.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _cpu import cpu_seconds, machine_spent

START_SLACK = 1.5  # seconds from submitting a step to its window: tasks start, replicas connect


@dataclass
class Step:
    """What :func:`run_step` measured: the tasks' results (one dict per replica) and errors
    (a task that failed, then each replica's ``error``), the measured span in seconds, the CPU
    seconds of each process in it (``used``, by the keys of ``pids`` and ``client``: this
    process, which hosts the scheduler), and the machine's (``spent`` per psutil field,
    ``busy``)."""

    outs: list[dict]
    errors: list[str]
    span: float
    used: dict[str, list[float]]
    spent: dict[str, float]
    busy: float

    def cores(self, key: str) -> float:
        """CPU seconds per second of the processes under ``key``."""
        return sum(self.used[key]) / self.span

    def machine(self) -> dict[str, float]:
        """The machine's busy cores (``machine_cores_busy``), of which ``softirq_cores`` (the
        kernel's loopback networking, which no process is charged for), ``steal_cores`` (the
        hypervisor's), and ``other_cores``: what is left after this benchmark's processes, the
        work of another job on a shared machine."""
        softirq = self.spent.get("softirq", 0.0)
        steal = self.spent.get("steal", 0.0)
        ours = sum(sum(u) for u in self.used.values())
        return {
            "machine_cores_busy": self.busy / self.span,
            "softirq_cores": softirq / self.span,
            "steal_cores": steal / self.span,
            "other_cores": (self.busy - softirq - steal - ours) / self.span,
        }


def run_step(
    client: Any,
    trainers: list[str],
    task: Callable[..., list[dict]],
    args: tuple,
    replicas: int,
    *,
    timing: tuple[float, float, float],
    pids: dict[str, list[int]],
    log: logging.Logger,
    noun: str,
) -> Step:
    """``replicas`` emulated replicas: on each TRAIN worker in ``trainers``, one task
    ``task(indices, replicas, window, *args)`` for its replicas' indices (returning a dict per
    index); ``timing = (slack_each, warmup, seconds)``: the window starts ``START_SLACK +
    replicas * slack_each`` seconds from now, runs ``warmup`` seconds unmeasured, then
    ``seconds`` measured, over which the processes of ``pids`` (and this one) are measured;
    ``window`` is ``(start, measure, end)``: a replica starts at ``start`` and counts what
    starts in ``[measure, end)``.
    Waits for the tasks (a failure is logged on ``log`` as "the ``noun`` of a N-replica step
    failed", and kept in the errors)."""
    import psutil
    from distributed import wait

    slack_each, warmup, seconds = timing
    start = time.time() + START_SLACK + replicas * slack_each
    measure = start + warmup
    end = measure + seconds
    window = (start, measure, end)
    futures = []
    for w, addr in enumerate(trainers):
        indices = list(range(w, replicas, len(trainers)))
        if indices:
            futures.append(
                client.submit(
                    task,
                    indices,
                    replicas,
                    window,
                    *args,
                    workers=[addr],
                    allow_other_workers=False,
                    pure=False,
                )
            )
    time.sleep(max(0.0, measure - time.time()))
    procs = {**pids, "client": [os.getpid()]}
    cpu0 = {k: cpu_seconds(v) for k, v in procs.items()}
    machine0 = psutil.cpu_times()
    t0 = time.time()
    time.sleep(max(0.0, end - time.time()))
    cpu1 = {k: cpu_seconds(v) for k, v in procs.items()}
    machine1 = psutil.cpu_times()
    span = time.time() - t0
    spent, busy = machine_spent(machine0, machine1)
    used = {k: [b - a for a, b in zip(cpu0[k], cpu1[k], strict=True)] for k in procs}
    errors: list[str] = []
    outs: list[dict] = []
    try:
        wait(futures, timeout=120 + replicas)
        for f in futures:
            outs += f.result()
    except Exception as exc:
        log.exception("the %s of a %d-replica step failed", noun, replicas)
        errors.append(repr(exc))
        for f in futures:
            f.cancel()
    errors += [o["error"] for o in outs if o.get("error")]
    return Step(outs, errors, span, used, spent, busy)


def replica_threads(
    indices: list[int], replica: Callable[[int, dict], None], name: str
) -> list[dict]:
    """In a Dask task: give the worker's slot back (a long task), then run ``replica(g, out)``
    for each ``g`` in ``indices``, each in a thread of its own (``{name}-{g}``) in a copy of
    the task's context (what the task's code finds its worker through); returns the ``out``
    dicts, in the order of ``indices``."""
    from distributed import secede

    secede()
    outs: list[dict] = [{} for _ in indices]
    threads = [
        threading.Thread(
            target=contextvars.copy_context().run,
            args=(replica, g, outs[k]),
            name=f"{name}-{g}",
            daemon=True,
        )
        for k, g in enumerate(indices)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def ms(v: float | None, digits: int) -> str:
    """A latency in ms for a log line, ``-`` when there is none."""
    return "-" if v is None else f"{v:.{digits}f}"
