"""HogwildReplica, the engine alone: threads learn lock-free, callbacks and stop work."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from adam_dask.errors import ConfigError, InputShapeError
from adam_dask.model import Network
from adam_dask.train.replica import HogwildReplica, TrainStats
from adam_dask.train.schedule import Schedule

SPEC = "conv3x3:4,maxpool2,fc16,fc4"
SHAPE = (1, 10, 10)


def synthetic(n, seed=0):
    """4 learnable classes: a bright bar in one of four places, plus noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.normal(0, 0.2, (n, *SHAPE)).astype(np.float32)
    for i, c in enumerate(y):
        if c < 2:
            x[i, 0, 2 + 5 * c : 4 + 5 * c, 1:9] += 1.0
        else:
            x[i, 0, 1:9, 2 + 5 * (c - 2) : 4 + 5 * (c - 2)] += 1.0
    return x, y


def batches(x, y, bs, epochs=1):
    for _ in range(epochs):
        for s in range(0, len(x), bs):
            yield x[s : s + bs], y[s : s + bs]


@pytest.fixture
def data():
    return synthetic(512)


def test_threads_learn(data):
    x, y = data
    net = Network.from_spec(SPEC, SHAPE, "tanh", seed=0)
    before, _ = net.loss_and_gradient(x, y)
    rep = HogwildReplica(net, threads=2, lr=0.1, momentum=0.0, batch_size=4)
    stats = rep.train(batches(x, y, 16, epochs=3))
    assert isinstance(stats, TrainStats)
    assert stats.images == 3 * len(x) and not stats.stopped and stats.seconds > 0
    after, _ = net.loss_and_gradient(x, y)
    assert after < 0.5 * before
    assert net.evaluate(x, y) > 0.9


def test_train_images_with_momentum_and_schedule(data):
    x, y = data
    net = Network.from_spec(SPEC, SHAPE, "relu", seed=0)
    before, _ = net.loss_and_gradient(x, y)
    rep = HogwildReplica(net, threads=2, lr=0.05, momentum=0.9, batch_size=8)
    plan = Schedule(lr=0.05, epochs=2, kind="linear", floor=0.1)
    seen = []
    stats = rep.train_images(
        x,
        y,
        epochs=2,
        seed=0,
        schedule=plan,
        on_epoch=lambda r, e, st: seen.append((e, r.lr, st.images)),
    )
    # the rate moves at every mini-batch: the last one of each epoch starts 8 images before its end
    last = (512 - 8) / 512
    assert [(e, n) for e, _, n in seen] == [(0, 512), (1, 512)]
    assert [lr for _, lr, _ in seen] == pytest.approx([plan.at(last), plan.at(1 + last)])
    assert plan.at(0) == 0.05 and plan.at(2) == pytest.approx(0.005)
    assert stats.images == 1024 and rep.images_seen == 1024
    assert net.loss_and_gradient(x, y)[0] < 0.5 * before
    # by default the plan is the epochs of the call, from the replica's lr, to the configured floor
    rep2 = HogwildReplica(Network.from_spec(SPEC, SHAPE, seed=0), threads=1, lr=0.05, batch_size=8)
    rep2.train_images(x[:64], y[:64], epochs=3)
    assert rep2.lr < 0.05 * 0.1


def test_uint8_images_and_per_image_updates():
    x, y = synthetic(64)
    x8 = (np.clip(x[:, 0], 0, 1) * 255).astype(np.uint8)
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    rep = HogwildReplica(net, threads=1, lr=0.05, momentum=0.0, batch_size=1)
    assert rep.train_images(x8, y).images == 64


def test_set_weights_copies_them_in_and_refuses_the_wrong_size(data):
    x, y = data
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    rep = HogwildReplica(net, threads=2, lr=0.1, momentum=0.0, batch_size=4)
    pulled = np.linspace(-0.1, 0.1, net.flat.size).astype(np.float32)
    rep.set_weights(pulled)
    np.testing.assert_array_equal(net.flat, pulled)
    rep.train(batches(x[:64], y[:64], 32))  # trains on from them
    assert not np.array_equal(net.flat, pulled)
    with pytest.raises(InputShapeError):
        rep.set_weights(np.zeros(3, np.float32))


def test_callback_every_k_images_while_training(data):
    """``on_images`` runs every ``every`` images on one training thread, never two at once,
    and what it changes (here the rate) is what the threads step with next."""
    x, y = data
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    rep = HogwildReplica(net, threads=2, lr=0.05, batch_size=4)
    calls, active, overlap = [], [0], []

    def halve(r):
        active[0] += 1
        overlap.append(active[0])
        time.sleep(0.002)  # a callback that takes a while: the other thread trains on
        r.lr /= 2
        calls.append(r.lr)
        active[0] -= 1

    stats = rep.train(batches(x, y, 16), on_images=halve, every=64)
    # at most 512 / 64; fewer when images arrive while a callback runs (one call covers them)
    assert 1 <= len(calls) <= 8
    assert max(overlap) == 1  # never two callbacks at once
    assert rep.lr == pytest.approx(0.05 / 2 ** len(calls))
    assert stats.images == 512
    # one thread: exactly every 64 images, and a rate of 0 from then on leaves the weights be
    solo = HogwildReplica(Network.from_spec(SPEC, SHAPE, seed=0), threads=1, lr=0.05, batch_size=4)
    seen = []

    def freeze(r):
        seen.append(r.net.flat.copy())
        r.lr = 1e-30

    assert solo.train(batches(x, y, 16), on_images=freeze, every=64).images == 512
    assert len(seen) == 8
    assert not np.array_equal(seen[0], Network.from_spec(SPEC, SHAPE, seed=0).flat)
    np.testing.assert_allclose(seen[-1], seen[0], atol=1e-6)


def test_stop_interrupts_promptly(data):
    x, y = data
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    rep = HogwildReplica(net, threads=2, lr=0.05, batch_size=4)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("s", rep.train(batches(x, y, 16, 10**6))))
    t.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    rep.stop()
    t.join(timeout=5)
    assert not t.is_alive() and time.perf_counter() - t0 < 1.0
    assert out["s"].stopped and out["s"].images > 0
    # an external event works too, and a new train() starts afresh
    ev = threading.Event()
    ev.set()
    assert rep.train(batches(x, y, 16), stop_event=ev).images == 0
    assert rep.train(batches(x[:32], y[:32], 16)).images == 32


def test_bad_batches_raise_in_the_caller(data):
    x, y = data
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    rep = HogwildReplica(net, threads=2, lr=0.05, batch_size=4)
    with pytest.raises(InputShapeError):
        rep.train([(x[:4, 0], y[:4])])
    with pytest.raises(InputShapeError):
        rep.train([(x[:4], y[:4] + 10)])


def test_config_defaults_and_bad_settings():
    net = Network.from_spec(SPEC, SHAPE, seed=0)
    import dask

    with dask.config.set(
        {"adam.cluster.trainer-threads": 3, "adam.train.batch-size": 5, "adam.train.lr": 0.02}
    ):
        rep = HogwildReplica(net)
    assert rep.threads == 3 and rep.batch_size == 5 and rep.lr == 0.02
    assert HogwildReplica(net, threads=2).threads == 2  # an argument wins over the config
    with pytest.raises(ConfigError):
        HogwildReplica(net, threads=0)
    with pytest.raises(ConfigError):
        HogwildReplica(net, momentum=1.5)
    with pytest.raises(ConfigError):
        HogwildReplica(net, batch_size=0)
