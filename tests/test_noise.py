"""The noisy neighbours the fault tests run beside (adam_dask.testing.noise): a CPU quota holds a
busy process to its fraction of a core, by the cpu cgroup where one can be made and by
SIGSTOP/SIGCONT everywhere; busy load runs its processes and takes them away."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from adam_dask.testing.noise import _SPIN, BusyLoad, CpuQuota, cpu_cgroup_root

MECHANISMS = ["signals"] + ([cpu_cgroup_root()[0]] if cpu_cgroup_root() else [])  # type: ignore[index]


@pytest.fixture
def spinner():
    p = subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_quota_holds_a_busy_process_to_its_fraction(spinner, mechanism):
    with CpuQuota([spinner.pid], 0.2, mechanism=mechanism) as quota:
        time.sleep(2.0)
    s = quota.stats
    assert s.mechanism == mechanism and s.seconds >= 2.0
    # it wanted a whole core: throttled in nearly every period, and used no more than allowed
    assert s.periods >= 15 and s.throttled >= 0.8 * s.periods, s
    assert s.cpu_seconds <= 1.1 * s.allowed_seconds + 0.1, s
    assert s.cpu_seconds >= 0.3 * s.allowed_seconds, s  # it ran meanwhile
    # lifted: it runs freely again (a cgroup quota's process is back in its own group)
    with open(f"/proc/{spinner.pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    assert state in "RS", state  # not left stopped


def test_a_quota_refuses_a_fraction_outside_zero_to_one():
    with pytest.raises(ValueError, match="fraction"):
        CpuQuota([os.getpid()], 1.5)


def test_busy_load_starts_its_processes_and_kills_them_at_exit():
    with BusyLoad(per_core=1, cores=2) as load:
        assert load.count == 2 and load.alive == 2
        procs = list(load.procs)
    assert all(p.poll() is not None for p in procs)
