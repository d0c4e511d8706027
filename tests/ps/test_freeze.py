"""A frozen primary (SIGSTOP from the test process: its sockets stay open, nothing answers) is
noticed by its missing heartbeats, fenced out and replaced while pushes go on, at the default
settings. A frozen host's worker (nothing there replaces it: ``adam.ps.replace-retired``
off) that wakes (SIGCONT) is no member any more, stale calls stamped with its old generation are refused, and the sums stay exact. A hung
worker whose nanny still answers is killed and replaced by a fresh one, so a cluster of three
PS workers gets back to three copies of every shard."""

from __future__ import annotations

import time

import dask
import numpy as np
import pytest

import adam_dask
from adam_dask.cluster import PS, workers_with_role
from adam_dask.ps import ParameterServer
from adam_dask.ps.protocol.shard import ShardCopy
from adam_dask.ps.runtime.rpc import call_actor
from adam_dask.testing import PushLoad, freeze, push_on, stop_and_check_sum, thaw

# beside three busy processes per core (tests/conftest.py): noisy neighbours, the bounds
# those of a quiet machine
pytestmark = pytest.mark.usefixtures("busy_load")

SHARD = 1 << 16
N = 3 * (SHARD // 4) + 11  # 4 shards


@pytest.fixture
def client():
    # 4 PS workers: with one frozen, every shard can still get 3 copies on distinct hosts
    with adam_dask.cluster.local(ps_nodes=4, data_nodes=0, trainers=0, memory_limit="1 GiB") as c:
        yield c


def wait_for(cond, what: str, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not after {timeout}s")


@pytest.mark.timeout(900)
def test_frozen_primary_fenced_replaced_and_refused_after_waking(client):
    s = ParameterServer.create(client, size=N, shard_bytes=SHARD)
    pushers = [PushLoad(s, 1), PushLoad(s, 2)]
    frozen: dict = {}
    try:
        before = s.routing_info()
        victim = before["routing"][0][0]
        old_key, old_gen = before["nodes"][victim], before["gens"][0]
        for p in pushers:
            p.start()
        push_on(pushers, 10)  # before the freeze
        with dask.config.set({"adam.ps.replace-retired": False}):  # a host that went silent
            frozen = freeze(client, [victim])  # whole: nothing there replaces the worker
            info = wait_for(
                lambda: (
                    (r := s.routing_info())["routing"][0][0] != victim and not r["pending"] and r
                ),
                "a new primary for shard 0",
            )
            push_on(pushers, 10)  # after the fail-over
            thaw(frozen)
            frozen = {}
        assert info["gens"][0] > old_gen and victim not in info["nodes"], info
        assert s.stats()["declared_dead"] >= 1

        # the woken node learns it is no member and serves nothing any more
        def woken_stats():
            return client.sync(call_actor, client.rpc, victim, old_key, "stats", timeout=10)

        wait_for(lambda: not woken_stats()["member"], "the woken node to stand down")
        assert woken_stats()["primaries"] == []

        # a forward stamped with the old generation is refused by a current copy, unchanged
        backup = info["routing"][0][1]
        backup_key = info["nodes"][backup]
        a, b = s.shards[0]
        stale = ShardCopy(0, a, b, 10**6, np.full(b - a, -1e9, np.float32), (), old_gen)
        got = client.sync(
            call_actor, client.rpc, backup, backup_key, "replicate", [stale], victim, timeout=30
        )
        assert got["held"] == {} and got["refused"][0] > old_gen
        # and so is a write-back report from the woken node
        refused = client.sync(
            client.scheduler.adam_ps_written,
            server_id=s.server_id,
            addr=victim,
            blocks={0: [old_gen, 10**6, "shards/0/stale"]},
        )
        assert refused["accepted"] == {} and 0 in refused["refused"]

        stop_and_check_sum(s, pushers)
        st = s.stats()
        assert st["refused_stale"] >= 2
        # the pushes went over the data plane, which met the frozen node (it held a shared
        # segment while frozen: that call was given up and its shards went the Dask way)
        assert st["data_plane"]["pushes"] > 20 and st["data_plane"]["failed_calls"] >= 1, st
    finally:
        if frozen:
            thaw(frozen)
        for p in pushers:
            p.stop.set()
        s.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_ps_worker_is_replaced_and_three_workers_hold_three_copies_again():
    """The default cluster's three PS workers: one hangs (SIGSTOP, its nanny alive). It is
    declared dead, its nanny kills it and starts a fresh worker, and every shard is back at
    three copies on three hosts, which two survivors alone could not give."""
    with adam_dask.cluster.local(ps_nodes=3, data_nodes=0, trainers=0, memory_limit="1 GiB") as c:
        s = ParameterServer.create(c, size=N, shard_bytes=SHARD)
        pushers = [PushLoad(s, 5), PushLoad(s, 6)]
        frozen: dict = {}
        try:
            victim = s.routing_info()["routing"][0][0]
            for p in pushers:
                p.start()
            push_on(pushers, 10)
            frozen = freeze(c, [victim])

            def healed():
                r = s.routing_info()
                holders = [set(h) for h in r["routing"]]
                whole = all(len(h) == 3 and victim not in h for h in holders)
                return r["healthy"] and not r["pending"] and whole and r

            info = wait_for(healed, "three copies of every shard without the hung worker")
            assert not _alive(frozen[victim])  # killed by its nanny, not left to wake
            assert len(workers_with_role(c, PS)) == 3 and victim not in workers_with_role(c, PS)
            assert all(len({a.split(":")[1] for a in h}) == 3 for h in info["routing"])
            push_on(pushers, 10)
            stop_and_check_sum(s, pushers)
        finally:
            thaw(frozen)
            for p in pushers:
                p.stop.set()
            s.close()
