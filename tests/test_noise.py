"""The noisy neighbours the fault tests run beside (adam_dask.testing.noise): a CPU quota holds a
busy process to its fraction of a core, by the cpu cgroup where one can be made and by
SIGSTOP/SIGCONT everywhere; busy load runs its processes and takes them away."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from adam_dask.testing.noise import BusyLoad, CpuQuota, cpu_cgroup_root, spin_command

MECHANISMS = ["signals"] + ([cpu_cgroup_root()[0]] if cpu_cgroup_root() else [])  # type: ignore[index]


@pytest.fixture
def spinner():
    p = subprocess.Popen(spin_command(), start_new_session=True)
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


def test_busy_processes_end_when_the_process_that_started_them_is_killed():
    """A test process SIGKILLed mid-test (its fixture's teardown never runs) leaves no busy
    process behind to load the tests after it."""
    starter = (
        "import sys, time\n"
        "from adam_dask.testing.noise import BusyLoad\n"
        "load = BusyLoad(per_core=1, cores=2).__enter__()\n"
        "print(' '.join(str(p.pid) for p in load.procs), flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_running(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for p in left:
        os.kill(p, 9)
    assert not left, f"busy processes outlived their parent: {left}"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_busy_load_fixture_runs_beside_the_body(busy_load):
    """The fault tests' load runs while their body does (their fixtures' clusters start quiet)."""
    assert busy_load.count == 3 * (os.cpu_count() or 1)
    assert busy_load.alive == busy_load.count
