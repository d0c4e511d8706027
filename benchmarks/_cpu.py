"""Where a benchmark's cores went (psutil): the CPU seconds of given processes, the whole
machine's busy CPU seconds, and a wait for a quiet machine (the capacity benchmarks' figures
need one: another job on a shared machine takes the cores they measure)."""

from __future__ import annotations

import logging
import time
from typing import Any

_logger = logging.getLogger(__name__)


def cpu_seconds(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process in ``pids``."""
    import psutil

    out = []
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        out.append(t.user + t.system)
    return out


def machine_spent(t0: Any, t1: Any) -> tuple[dict[str, float], float]:
    """CPU seconds of the whole machine between two psutil.cpu_times(): per field, and busy
    (all but idle and iowait; guest time is counted in user time already)."""
    spent = {f: getattr(t1, f) - getattr(t0, f) for f in t1._fields}
    busy = sum(v for f, v in spent.items() if f not in ("idle", "iowait", "guest", "guest_nice"))
    return spent, busy


def machine_busy(seconds: float) -> float:
    """Busy cores of the whole machine over ``seconds``."""
    import psutil

    t0 = psutil.cpu_times()
    time.sleep(seconds)
    return machine_spent(t0, psutil.cpu_times())[1] / seconds


def wait_quiet(timeout: float, below: float = 0.3, log: logging.Logger | None = None) -> float:
    """Wait (up to ``timeout`` seconds) until the machine's busy cores over 3 s are under
    ``below`` (other work on a shared machine); returns the last figure. Each wait is logged
    (INFO) on ``log``."""
    log = log or _logger
    deadline = time.monotonic() + timeout
    busy = machine_busy(3.0)
    while busy >= below and time.monotonic() < deadline:
        log.info("the machine is busy (%.2f cores): waiting for it to be quiet", busy)
        busy = machine_busy(3.0)
    return busy
