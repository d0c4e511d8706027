"""Noisy neighbours, sent from outside the processes they slow: busy processes beside a run (other
tenants of a shared server), and a CPU quota held on a process (the kernel's CFS bandwidth
control, as Kubernetes enforces a pod's CPU limit: the process runs for ``fraction`` of each
period and is stopped for the rest).

Used by the fault tests (``tests/conftest.py``'s ``busy_load``) and ``benchmarks/chaos.py``
(``--load``, ``--throttle``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BusyLoad", "CpuQuota", "QuotaStats", "cpu_cgroup_root", "load_average"]

logger = logging.getLogger(__name__)

# a busy process: pure Python, so it competes for a core as a tenant's interpreter does
# busy until its parent is gone: a test process killed before its fixture's teardown (a
# timeout's SIGKILL, an interrupted run) leaves no load behind to slow the tests after it
# (the parent's pid comes as an argument: read at the child's start, it is already 1 when the
# parent died first)
_SPIN = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n    pass\n"


def spin_command() -> list[str]:
    """The command of one busy process, busy until the calling process is gone."""
    return [sys.executable, "-c", _SPIN, str(os.getpid())]


def load_average() -> float:
    """The machine's 1-minute load average."""
    return round(os.getloadavg()[0], 2)


class BusyLoad:
    """``per_core`` busy processes per core (``os.cpu_count()``) beside the caller, at the same
    priority; a context manager. Each runs in a session of its own and is killed at exit, and
    one that dies meanwhile is not replaced (:attr:`alive` says how many still run)."""

    def __init__(self, per_core: float = 3.0, cores: int | None = None):
        self.cores = cores or os.cpu_count() or 1
        self.count = max(0, round(per_core * self.cores))
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> BusyLoad:
        for _ in range(self.count):
            self.procs.append(
                subprocess.Popen(
                    spin_command(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        logger.info("%d busy processes started (%d cores)", self.count, self.cores)
        return self

    @property
    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        self.procs.clear()


@dataclass
class QuotaStats:
    """What the quota did: ``mechanism`` ("cgroup-v1", "cgroup-v2" or "signals"), the CFS
    periods it ran and in how many the processes were throttled (signals: every period), the
    seconds it was held and the CPU seconds the processes used meanwhile (every thread, from
    ``/proc``)."""

    mechanism: str
    fraction: float
    periods: int = 0
    throttled: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    pids: list[int] = field(default_factory=list)

    @property
    def allowed_seconds(self) -> float:
        """The CPU seconds the quota allowed while it was held."""
        return self.fraction * self.seconds

    def as_record(self) -> dict:
        return {
            "mechanism": self.mechanism,
            "fraction": self.fraction,
            "periods": self.periods,
            "throttled_periods": self.throttled,
            "seconds": round(self.seconds, 2),
            "cpu_seconds": round(self.cpu_seconds, 2),
        }


def cpu_cgroup_root() -> tuple[str, Path] | None:
    """("cgroup-v1", its cpu hierarchy) or ("cgroup-v2", the unified root) where this process
    may make a cgroup with a CPU quota; None where neither can be written (no root, no cpu
    controller)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return "cgroup-v1", v1
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        if os.access(v2, os.W_OK):
            return "cgroup-v2", v2
    return None


class CpuQuota:
    """Hold the processes ``pids`` (and the threads and children they have) to ``fraction`` of
    one core: a cgroup of their own with a CFS quota of ``fraction`` x ``period`` seconds per
    ``period`` (cgroup v1's ``cpu.cfs_quota_us``, v2's ``cpu.max``), or, where no cgroup can be
    made, SIGSTOP and SIGCONT from a thread of this process (stopped ``1 - fraction`` of every
    period). A context manager; at exit the processes go back to the cgroup they came from and
    :attr:`stats` says what the quota did."""

    def __init__(
        self,
        pids: Iterable[int],
        fraction: float = 0.1,
        period: float = 0.1,
        *,
        mechanism: str | None = None,
    ):
        if not 0 < fraction < 1:
            raise ValueError(f"a CPU quota's fraction must be in (0, 1), not {fraction}")
        self.pids = sorted(set(int(p) for p in pids))
        self.fraction = fraction
        self.period = period
        found = cpu_cgroup_root()
        if mechanism is None:
            mechanism = found[0] if found else "signals"
        if mechanism != "signals" and (found is None or found[0] != mechanism):
            raise RuntimeError(f"no writable {mechanism} cpu controller here")
        self.mechanism = mechanism
        self.root = found[1] if found and mechanism != "signals" else None
        self.group: Path | None = None
        self.home: dict[int, Path] = {}
        self.stats = QuotaStats(mechanism, fraction, pids=list(self.pids))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._cpu0 = 0.0

    # -- cgroups ---------------------------------------------------------------------------------
    def _own_group(self, pid: int) -> Path:
        """The cgroup ``pid`` is in now, in this hierarchy."""
        assert self.root is not None
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if self.mechanism == "cgroup-v2" and controllers == "":
                    return self.root / path.lstrip("/")
                if self.mechanism == "cgroup-v1" and "cpu" in controllers.split(","):
                    return self.root / path.lstrip("/")
        return self.root

    def _enter_cgroup(self) -> None:
        assert self.root is not None
        self.group = self.root / f"adam-quota-{uuid.uuid4().hex[:8]}"
        self.group.mkdir()
        period_us = int(self.period * 1e6)
        quota_us = max(1000, int(self.fraction * self.period * 1e6))
        if self.mechanism == "cgroup-v1":
            (self.group / "cpu.cfs_period_us").write_text(str(period_us))
            (self.group / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (self.group / "cpu.max").write_text(f"{quota_us} {period_us}")
        for pid in self.pids:
            try:
                self.home[pid] = self._own_group(pid)
                (self.group / "cgroup.procs").write_text(str(pid))
            except (ProcessLookupError, FileNotFoundError):
                logger.info("process %d is gone: not held under the quota", pid)

    def _cgroup_counts(self) -> tuple[int, int]:
        assert self.group is not None
        stat = dict(
            line.split() for line in (self.group / "cpu.stat").read_text().splitlines() if line
        )
        return int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0))

    def _leave_cgroup(self) -> None:
        assert self.group is not None and self.root is not None
        try:
            self.stats.periods, self.stats.throttled = self._cgroup_counts()
        except OSError:
            pass
        # every process and thread in it goes back (children it started meanwhile too)
        for _ in range(3):
            procs = [int(p) for p in (self.group / "cgroup.procs").read_text().split()]
            if not procs:
                break
            for pid in procs:
                home: Path = self.home.get(pid, self.root)
                try:
                    (home / "cgroup.procs").write_text(str(pid))
                except (ProcessLookupError, OSError):
                    pass
        try:
            self.group.rmdir()
        except OSError as e:
            logger.warning("the quota's cgroup %s was not removed: %s", self.group, e)

    # -- signals ---------------------------------------------------------------------------------
    def _duty_cycle(self) -> None:
        running = self.fraction * self.period
        while not self._stop.is_set():
            self._send(signal.SIGCONT)
            time.sleep(running)
            self._send(signal.SIGSTOP)
            self.stats.periods += 1
            self.stats.throttled += 1
            self._stop.wait(self.period - running)
        self._send(signal.SIGCONT)

    def _send(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _cpu_seconds(self) -> float:
        """User and system CPU seconds the processes used so far (those still alive)."""
        total = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        return total / os.sysconf("SC_CLK_TCK")

    # -- the context -----------------------------------------------------------------------------
    def __enter__(self) -> CpuQuota:
        self._t0 = time.monotonic()
        self._cpu0 = self._cpu_seconds()
        if self.mechanism == "signals":
            self._thread = threading.Thread(target=self._duty_cycle, name="cpu-quota", daemon=True)
            self._thread.start()
        else:
            self._enter_cgroup()
        logger.info(
            "processes %s held to %.0f%% of a core (%s)",
            self.pids,
            100 * self.fraction,
            self.mechanism,
        )
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self._leave_cgroup()
        self.stats.seconds = time.monotonic() - self._t0
        self.stats.cpu_seconds = self._cpu_seconds() - self._cpu0
        logger.info("quota lifted: %s", self.stats.as_record())
