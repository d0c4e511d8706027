"""The engine's exact update bookkeeping (:mod:`adam_dask.train._updates`): what Hogwild threads
apply lock-free is taken and installed without an update lost or counted twice. No cluster."""

from __future__ import annotations

import threading

import numpy as np

from adam_dask.train._updates import Updates


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
