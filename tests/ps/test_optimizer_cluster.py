"""The server optimizer on a real cluster: a PS primary SIGKILLed mid-stream with ``nesterov``
on loses no acknowledged push, applies each once, and ends at the bits of a replay of the
pushes in the order they were applied; the momentum survives a restore from the checkpoint;
a push's staleness is counted from the versions its handle read, on the data plane and over
Dask alike."""

from __future__ import annotations

import random

import dask
import numpy as np
import pytest

from adam_dask.ps import ParameterServer
from adam_dask.ps.protocol.shard_kernels import nesterov_step
from adam_dask.testing import PushLoad, push_on
from adam_dask.testing import hard_kill as kill_workers

from .test_failover import SHARD, N, check_placement, wait_healed


def push_ids(seed: int, n: int) -> list[int]:
    """The ids a handle whose id generator was seeded with ``seed`` gives its first ``n``
    pushes."""
    rng = random.Random(seed)
    return [rng.getrandbits(62) for _ in range(n)]


def applied_order(s: ParameterServer, sid: int) -> list[int]:
    """The push ids shard ``sid``'s primary applied, in the order it applied them (its
    lineage's: a promoted backup's values and momentum came from the primary before it)."""
    primary = s.placement()[sid][0]
    answers = s._courier.ask_nodes("applied", sid)
    return [p for _, p in answers[primary]]


def replay(s: ParameterServer, pusher: PushLoad, seed: int) -> np.ndarray:
    """The values every shard should hold: the acknowledged pushes of ``pusher`` replayed
    through the optimizer in the order each shard's surviving copy applied them."""
    ids = push_ids(seed, pusher.count)
    delta_of = {pid: pusher.deltas[k % len(pusher.deltas)] for k, pid in enumerate(ids)}
    opt = s.optimizer
    out = np.zeros(s.size, np.float32)
    for sid, (a, b) in enumerate(s.shards):
        order = applied_order(s, sid)
        assert sorted(order) == sorted(ids), f"shard {sid}: not every push applied once"
        v, m = out[a:b], np.zeros(b - a, np.float32)
        for pid in order:
            nesterov_step(v, m, np.ascontiguousarray(delta_of[pid][a:b]), opt.lr, opt.momentum, 1.0)
    return out


def test_kill_primary_mid_stream_with_nesterov(ps_client):
    s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD, optimizer="nesterov")
    try:
        assert s.optimizer.kind == "nesterov" and s.optimizer.momentum > 0
        victim = s.placement()[0][0]
        s._rng.seed(11)  # known push ids: the test maps each to its delta
        pusher = PushLoad(s, 11)
        pusher.start()
        push_on([pusher], 15)
        kill_workers(ps_client, [victim])
        wait_healed(s, {victim})
        push_on([pusher], 15)  # pushes go on after the heal
        pusher.stop.set()
        pusher.join(60)
        assert pusher.error is None, pusher.error
        s.flush()
        # each acknowledged push applied once: every shard's version counts them
        assert set(s.versions().values()) == {pusher.count}
        expect = replay(s, pusher, 11)
        np.testing.assert_array_equal(s.pull(), expect)
        check_placement(s)
    finally:
        s.close()


def test_restore_keeps_the_momentum(ps_client, tmp_path):
    url = str(tmp_path / "ckpt")
    rng = np.random.default_rng(5)
    ds = [rng.normal(0, 1, N).astype(np.float32) for _ in range(4)]
    s = ParameterServer.create(
        ps_client, size=N, shard_bytes=SHARD, checkpoint=url, optimizer="nesterov"
    )
    try:
        for d in ds[:3]:
            s.push(d)
        s.flush()  # the checkpoint holds the values and the momentum
        s.push(ds[3])
        s.flush()
        after = s.pull()
    finally:
        s.close()
    r = ParameterServer.restore(ps_client, url)
    try:
        assert r.optimizer == s.optimizer
        np.testing.assert_array_equal(r.pull(), after)
        r.push(ds[0])  # the restored momentum: the same step the first server would take
        v, m = np.zeros(N, np.float32), np.zeros(N, np.float32)
        for d in [*ds, ds[0]]:
            nesterov_step(v, m, d, r.optimizer.lr, r.optimizer.momentum, 1.0)
        np.testing.assert_array_equal(r.pull(), v)
    finally:
        r.close()


@pytest.mark.parametrize("plane", ["auto", "dask"])
def test_staleness_counts_the_versions_moved_since_the_read(ps_client, plane):
    """On the data plane and over Dask (``adam.ps.data-plane: dask``) alike: a pull's versions
    come back, the next push names them (``bases``) and the node counts its staleness."""
    s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD, optimizer="sum+staleness")
    other = ParameterServer.attach(ps_client, s.server_id)
    with dask.config.set({"adam.ps.data-plane": plane}):
        check_staleness(s, other, plane)


def check_staleness(s: ParameterServer, other: ParameterServer, plane: str) -> None:
    try:
        assert other.optimizer.name == "sum+staleness"
        s.pull()  # s reads version 0 of every shard
        ones = np.ones(N, np.float32)
        for _ in range(3):
            other.push(ones)  # three versions later...
        s.push(np.full(N, 4.0, np.float32))  # ...s's push counts a quarter
        np.testing.assert_array_equal(s.pull(), np.full(N, 3.0 + 1.0, np.float32))
        s.push(np.full(N, 2.0, np.float32))  # read just now: not stale
        np.testing.assert_array_equal(s.pull(), np.full(N, 6.0, np.float32))
        other.settle(checkpoint=False)
        nodes = s.stats()["nodes"].values()
        moved = {k: sum(n["by_transport"][k] for n in nodes) for k in ("plane", "dask")}
        assert moved["dask" if plane == "auto" else "plane"] == 0  # the transport asked for
    finally:
        s.close()
