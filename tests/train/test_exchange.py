"""The exchange with the parameter server is exact: no update lost or pushed twice, however pulls
land; a synchronous step that waits too long names the replicas it waited for. No cluster: an
in-process stand-in plays the parameter server."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from adam_dask.errors import ClusterError
from adam_dask.model import Network
from adam_dask.train._exchange import AsyncExchange, SyncExchange
from adam_dask.train._updates import Updates
from adam_dask.train.replica import HogwildReplica
from adam_dask.train.task import SyncBarrier


class InProcessServer:
    """The parameter server's push / push_outer / pull, in float64, under a lock."""

    def __init__(self, init: np.ndarray):
        self.values = init.astype(np.float64)
        self.lock = threading.Lock()
        self.pushes = 0

    def push(self, delta: np.ndarray) -> None:
        with self.lock:
            self.values += delta
            self.pushes += 1

    def push_outer(self, offset, errors, activations, scale=1.0) -> None:
        update = scale * (errors.astype(np.float64).T @ activations.astype(np.float64))
        with self.lock:
            self.values[offset : offset + update.size] += update.ravel()

    def pull(self) -> np.ndarray:
        with self.lock:
            return self.values.astype(np.float32)


def test_no_update_lost_or_doubled_over_thousands_of_pulls():
    """Three threads apply updates lock-free while a fourth takes, 'pushes' and installs pulled
    weights as fast as it can. Every value is a multiple of 2**-8 well inside float32's exact
    range, so the sums are exact and any update dropped or counted twice shows as inequality."""
    size, threads, want_pulls, big = 2048, 3, 3000, 10**9
    rng = np.random.default_rng(0)
    base = (rng.integers(-3, 4, (16, size)) * 2.0**-8).astype(np.float32)
    flat = np.zeros(size, np.float32)
    ups = Updates(size, threads)
    ledgers = [np.zeros(size, np.float64) for _ in range(threads)]
    server = np.zeros(size, np.float64)
    pushed_items: dict[int, int] = {}
    applied = [0] * threads
    enough, done = threading.Event(), threading.Event()
    pulls = [0]

    def train(t: int) -> None:  # until the exchange has pulled want_pulls times
        grad = np.empty(size, np.float32)
        velocity = np.zeros(1, np.float32)
        while not enough.is_set():
            i = applied[t]
            g = base[(7 * t + i) % len(base)]
            grad[:] = g  # apply_update zeroes it, as after every mini-batch
            ledgers[t] -= g
            ups.apply(t, flat, grad, velocity, 1.0, 0.0, images=1, item=t * big + i)
            applied[t] += 1

    def exchange() -> None:
        while True:
            finished = done.is_set()
            u = ups.take()
            server[...] += u.delta
            for k, m in u.items.items():
                pushed_items[k] = pushed_items.get(k, 0) + m
            ups.install(flat, server.astype(np.float32))
            pulls[0] += 1
            if pulls[0] >= want_pulls:
                enough.set()
            if finished:
                return

    trainers = [threading.Thread(target=train, args=(t,)) for t in range(threads)]
    comm = threading.Thread(target=exchange)
    comm.start()
    for th in trainers:
        th.start()
    for th in trainers:
        th.join()
    done.set()
    comm.join()

    assert pulls[0] > want_pulls and min(applied) > 0
    np.testing.assert_array_equal(server, sum(ledgers))  # every update pushed exactly once
    assert pushed_items == {t * big + i: 1 for t in range(threads) for i in range(applied[t])}
    np.testing.assert_array_equal(flat, server.astype(np.float32))  # the last install
    assert not ups.pending().any()


SPEC = "conv3x3:4,maxpool2,fc16,fc4"
SHAPE = (1, 10, 10)


def _batches(n: int, bs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(0, n, bs):
        y = rng.integers(0, 4, bs)
        x = rng.normal(0, 0.2, (bs, *SHAPE)).astype(np.float32)
        x[np.arange(bs), 0, 1 + 2 * y, :] += 1.0
        yield x, y


@pytest.mark.parametrize("offload", [False, True])
def test_async_exchange_pushes_every_image_once(offload):
    """A real replica (one thread, so its local weights are exact too) pushes every 8 images
    through the exchange's communicator thread, thousands of times; the server ends with exactly
    what the replica computed and every image counted once."""
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    server = InProcessServer(net.flat)
    rep = HogwildReplica(
        net, threads=1, lr=0.05, momentum=0.0, batch_size=4, offload=["2"] if offload else None
    )
    ex = AsyncExchange(rep, server, label="replica 0")
    stats = rep.train(_batches(16000, 16), on_images=lambda r: ex.step(), every=8)
    ex.finish()
    assert stats.images == 16000 and ex.images_pushed == 16000
    # a pull per push but finish's last; a push due while one is in flight joins the next
    assert 100 < ex.pushes <= 2000 and ex.pushes - 1 <= ex.pulls <= ex.pushes
    assert ex.items == {k: 16 for k in range(1000)}  # every stream item, all its images
    np.testing.assert_allclose(server.values, net.flat, atol=2e-3)


class SlowServer(InProcessServer):
    """Every push takes a while, so the replica takes its next update while one is in flight."""

    def push(self, delta: np.ndarray) -> None:
        time.sleep(0.002)
        super().push(delta)


@pytest.mark.parametrize("offload", [False, True])
def test_a_replica_against_a_slow_server_follows_its_path_alone(offload):
    """One thread against a slow server: the replica trains on while each push is in flight
    and installs the weights pulled after it. It follows the path it takes with no server at
    all, and the server ends there: an update lost, pushed twice or installed without the
    replica's steps since would show. (An install is a Hogwild write: a mini-batch applied
    during it can be lost from the local weights, never from the pushes, and the offloaded
    layers are summed on the server in float64: so to 2e-3, a few mini-batches' steps.)"""
    alone = Network.from_spec(SPEC, SHAPE, seed=0)
    HogwildReplica(alone, threads=1, lr=0.05, momentum=0.0, batch_size=4).train(_batches(4000, 16))
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    server = SlowServer(net.flat)
    rep = HogwildReplica(
        net, threads=1, lr=0.05, momentum=0.0, batch_size=4, offload=["2"] if offload else None
    )
    ex = AsyncExchange(rep, server, label="replica 0")
    rep.train(_batches(4000, 16), on_images=lambda r: ex.step(), every=8)
    ex.finish()
    assert ex.pulls > 5 and ex.images_pushed == 4000
    np.testing.assert_allclose(server.values, alone.flat, atol=2e-3)
    np.testing.assert_allclose(net.flat, alone.flat, atol=2e-3)


class SlowerServer(InProcessServer):
    """Every push takes 5 ms: far longer than a few mini-batches of the small net."""

    def push(self, delta: np.ndarray) -> None:
        time.sleep(0.005)
        super().push(delta)


@pytest.mark.parametrize("damp", [True, False])
def test_pushes_due_while_one_is_in_flight_join_the_next_and_damp_the_rate(damp):
    """Against a server slower than training, the pushes that fall due while one is in flight
    leave as one (fewer, larger pushes; every image still pushed once), and a replica among
    others (``damp``) steps at a rate damped by the period it pushed at; one alone is not."""
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    server = SlowerServer(net.flat)
    rep = HogwildReplica(net, threads=1, lr=0.05, momentum=0.0, batch_size=4)
    ex = AsyncExchange(rep, server, label="replica 0", push_every=8, damp=damp)
    stats = rep.train(_batches(8000, 16), on_images=lambda r: ex.step(), every=8)
    ex.finish()
    assert stats.images == ex.images_pushed == 8000
    assert ex.pushes < 8000 // 8 // 2 and ex.pace.period > 16
    if damp:
        assert rep.damping == pytest.approx((8 + 4) / ex.pace.period)
    else:
        assert rep.damping == 1.0
    np.testing.assert_allclose(server.values, net.flat, atol=2e-3)


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

    net = Network.from_spec(SPEC, SHAPE, seed=0)
    rep = HogwildReplica(net, threads=1, lr=0.05, batch_size=4)
    ex = SyncExchange(
        rep, InProcessServer(net.flat), wait=lambda: late[0], scale=0.5, label="replica 0"
    )
    with pytest.raises(ClusterError, match=r"replica\(s\) 1.*sync-timeout"):
        rep.train(_batches(64, 16), on_images=lambda r: ex.step(), every=8)


def test_sync_barrier_lets_a_finished_replica_leave():
    async def scenario():
        barrier = SyncBarrier(2)
        waiting = asyncio.ensure_future(barrier.wait(0, 5.0))
        await asyncio.sleep(0.05)
        left = await barrier.leave(1)  # replica 1 is done with its share
        return left, await waiting

    left, answer = asyncio.run(scenario())
    assert left == 1 and answer["ok"]


def test_the_parameter_server_handle_lends_the_exchange_its_buffer_pool():
    """The exchange pushes from and pulls into the handle's buffers (no copy on this side)
    when the server has a pool (PooledPushes); the in-process stand-in has none."""
    from adam_dask.ps.client.server import ParameterServer
    from adam_dask.train._handle import PooledPushes

    assert issubclass(ParameterServer, PooledPushes)
    assert not isinstance(InProcessServer(np.zeros(1, np.float32)), PooledPushes)
