"""The synchronous mode's barrier (a Dask actor's class, driven here in one event loop): a step
waits for every replica still in the epoch, a step that waits too long names the replicas it
waited for (and the replica's exchange raises that as one error), a finished replica leaves."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from adam_dask.errors import ClusterError
from adam_dask.model import Network
from adam_dask.model.stage import WholeStage
from adam_dask.train._stage_exchange import StageExchange
from adam_dask.train.task import SyncBarrier

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


class _Store:
    """The parameter server's ranged push and pull, in-process."""

    def __init__(self, flat: np.ndarray):
        self.flat = flat.copy()

    def push_range(self, values, start, *, mark=None, out=None):
        self.flat[start : start + len(values)] += values
        return out

    def pull_range(self, start, stop, *, out):
        out[...] = self.flat[start:stop]
        return out


def test_sync_barrier_timeout_names_the_missing_replicas():
    async def scenario():
        barrier = SyncBarrier(3)
        first = await asyncio.gather(barrier.wait(0, 5.0), barrier.wait(1, 5.0), barrier.wait(2, 5))
        late = await asyncio.gather(barrier.wait(0, 0.2), barrier.wait(2, 0.2))
        after = await barrier.wait(1, 0.2)  # the straggler arrives after the step failed
        return first, late, after

    first, late, after = asyncio.run(scenario())
    assert all(a["ok"] for a in first)
    assert [a["ok"] for a in late] == [False, False]
    assert late[0]["missing"] == [1] and late[0]["generation"] == 1
    assert not after["ok"]  # it stops too: the run does not go on unsynchronised

    # a replica's exchange at that barrier: its push lands, then the step's error names replica 1
    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    store = _Store(net.flat)
    errors: list = []
    left: list = []
    exchange = StageExchange(
        WholeStage(net, ()),
        store,
        part=(0, 1),
        threads=1,
        mark=(0, 0, 2),
        dropped=lambda: False,
        on_error=errors.append,
        on_left=lambda: left.append(1),
        barrier=lambda: late[0],
        label="replica 0 in epoch 0",
    )
    exchange.acc(0, 0)[:] = 2.0
    exchange.take(0, 1, [], 8)
    deadline = time.monotonic() + 30
    while not errors:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    exchange.close()
    (error,) = errors
    assert isinstance(error, ClusterError)
    assert "replica 0 in epoch 0 waited 0.2 s for replica(s) 1" in str(error)
    assert "sync-timeout" in str(error)
    np.testing.assert_allclose(store.flat, net.flat + 1.0)  # pushed at 1/R before the wait


def test_sync_barrier_lets_a_finished_replica_leave():
    async def scenario():
        barrier = SyncBarrier(2)
        waiting = asyncio.ensure_future(barrier.wait(0, 5.0))
        await asyncio.sleep(0.05)
        left = await barrier.leave(1)  # replica 1 is done with its share
        return left, await waiting

    left, answer = asyncio.run(scenario())
    assert left == 1 and answer["ok"]
