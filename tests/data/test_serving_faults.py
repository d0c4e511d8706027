"""Data servers that freeze: a DATA worker stopped with SIGSTOP (sockets open, nothing answers)
mid-epoch. Its partition moves to the other DATA worker, or to the stream itself when there is
none and back once the worker answers again; every image of the epoch arrives exactly once, and
the frozen server is found by a liveness probe, not by waiting out ``call-timeout``."""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import pytest

import adam_dask
from adam_dask import config
from adam_dask.data import Augment, DataService, load_arrays
from adam_dask.testing import freeze, synthetic_store, thaw

N_TRAIN = 1024
AUG = Augment(rotation=8.0, translation=1.5)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return synthetic_store(tmp_path_factory.mktemp("faults"), n_train=N_TRAIN, n_test=64)


@pytest.fixture(scope="module")
def arrays(store):
    return load_arrays(store, "train")


def check_exactly_once(batches, arrays, seed: int, epoch: int) -> None:
    """Every image of the split once, each batch the right labels and augmentation."""
    images, labels = arrays
    idx = np.concatenate([b[2] for b in batches])
    assert len(idx) == N_TRAIN and np.array_equal(np.sort(idx), np.arange(N_TRAIN))
    for x, y, i in batches:
        assert np.array_equal(y, labels[i])
        np.testing.assert_array_equal(x, AUG.apply(images[i], i, seed=seed, epoch=epoch))


@contextmanager
def serving(store, *, data_nodes: int, trainers: int = 0, seed: int, batch_size: int):
    """An embedded cluster with ``data_nodes`` DATA workers and a DataService on it, as
    ``(client, service, pids)``; the workers the body freezes into ``pids`` are thawed at the end."""
    with adam_dask.cluster.local(
        ps_nodes=0, data_nodes=data_nodes, trainers=trainers, memory_limit="2 GiB"
    ) as client:
        svc = DataService.create(client, store, augment=AUG, seed=seed, batch_size=batch_size)
        pids: dict[str, int] = {}
        try:
            yield client, svc, pids
        finally:
            thaw(pids)
            svc.close()


def replica_task(service, replica: int, replicas: int, before: int, go: str):
    """On a TRAIN worker: take ``before`` batches, say so, wait for ``go``, take the rest."""
    from distributed import Event

    stream = service.stream(replica, replicas, 0, return_index=True)
    got = [next(stream) for _ in range(before)]
    Event(f"{go}-ready").set()
    Event(go).wait(timeout=60)
    got.extend(stream)
    return got, stream.stats()


def test_a_frozen_data_server_is_replaced_and_the_epoch_completes_once(store, arrays):
    from distributed import Event

    with serving(store, data_nodes=2, trainers=1, seed=5, batch_size=32) as (client, svc, pids):
        victim = svc.servers()[0]
        other = svc.servers()[1]
        task = client.submit(replica_task, svc, 0, 2, 4, "go", resources={"TRAIN": 1}, pure=False)
        here = svc.stream(1, 2, 0, return_index=True)
        got = [next(here) for _ in range(4)]
        assert Event("go-ready", client=client).wait(timeout=60)
        pids.update(freeze(client, [victim]))  # both streams are part-way through the epoch
        Event("go", client=client).set()
        got.extend(here)
        remote, remote_stats = task.result()
        check_exactly_once(got + remote, arrays, seed=5, epoch=0)
        for st in (here.stats(), remote_stats):
            assert st["images"] == st["share_images"] == N_TRAIN // 2
            # the frozen server was found by a probe, never by waiting out call-timeout
            assert st["recoveries"] >= 1 and st["unanswered"] >= 1
            assert st["call_timeouts"] == 0
            assert st["local_batches"] == 0  # the other DATA worker took the partition
        assert svc.generation(0) >= 1 and svc.servers()[0] == other
        # the next epoch goes straight to the new server
        later = svc.stream(0, 1, 1, return_index=True)
        check_exactly_once(list(later), arrays, seed=5, epoch=1)
        assert later.stats()["recoveries"] == 0


def test_the_only_data_server_frozen_serves_locally_then_returns(store, arrays):
    with serving(store, data_nodes=1, seed=2, batch_size=16) as (client, svc, pids):
        (victim,) = svc.servers()
        stream = svc.stream(0, 1, 0, return_index=True)
        assert len(stream) == N_TRAIN // 16
        got = [next(stream) for _ in range(5)]
        pids.update(freeze(client, [victim]))
        got.extend(next(stream) for _ in range(5))  # no DATA worker left: served here
        frozen = stream.stats()
        assert frozen["unanswered"] == 1 and frozen["local_batches"] >= 1
        assert frozen["call_timeouts"] == 0
        deadline = time.monotonic() + 60  # its heartbeats stop reaching the scheduler
        while victim in (svc.live_data_workers() or ()):
            assert time.monotonic() < deadline, "a frozen worker still counts as live"
            time.sleep(0.2)
        thaw(pids)
        pids.clear()
        deadline = time.monotonic() + 60
        while victim not in (svc.live_data_workers() or ()):
            assert time.monotonic() < deadline, "the thawed worker sends no heartbeats"
            time.sleep(0.2)
        time.sleep(float(config.get("serving.return-interval")))  # the stream looks again
        got.extend(stream)
        check_exactly_once(got, arrays, seed=2, epoch=0)
        st = stream.stats()
        assert st["returns"] == 1  # back on the DATA worker for the rest of the epoch
        assert st["local_batches"] == frozen["local_batches"]  # none served here since
        assert svc.servers() == [victim]


def test_late_heartbeats_alone_lose_no_server(store, arrays):
    """The scheduler's view of a DATA worker can lag (a loaded machine delivers heartbeats
    seconds late): a stream then still opens its partitions on the servers, which answer, and
    loses none of them; only an unanswered ping loses a server."""
    import dask

    with serving(store, data_nodes=2, seed=3, batch_size=32) as (_, svc, _pids):
        servers = svc.servers()
        # every heartbeat now counts as late: no DATA worker is live by the scheduler's view
        with dask.config.set({"adam.serving.heartbeat-timeout": -1.0}):
            assert svc.live_data_workers() == []
            stream = svc.stream(0, 1, 0, return_index=True)
            got = list(stream)
        check_exactly_once(got, arrays, seed=3, epoch=0)
        st = stream.stats()
        assert st["recoveries"] == 0 and st["unanswered"] == 0
        assert st["local_batches"] == 0  # served by the DATA workers, not here
        assert svc.servers() == servers and svc.generation(0) == 0


def test_a_stream_opened_on_a_frozen_server_moves_its_partition(store, arrays):
    """A stream that opens while a DATA worker is frozen finds it by the probe of its open,
    whatever the scheduler's heartbeats say yet, and the other DATA worker takes the partition."""
    with serving(store, data_nodes=2, seed=4, batch_size=32) as (client, svc, pids):
        victim, other = svc.servers()
        pids.update(freeze(client, [victim]))
        stream = svc.stream(0, 1, 0, return_index=True)
        got = list(stream)
        check_exactly_once(got, arrays, seed=4, epoch=0)
        st = stream.stats()
        assert st["recoveries"] == 1 and st["unanswered"] == 1
        assert st["call_timeouts"] == 0 and st["local_batches"] == 0
        assert svc.servers() == [other, other]


def test_streams_losing_one_server_at_once_start_one_replacement(store, arrays, caplog):
    """Every replica's stream loses the frozen server at the same moment; one of them starts
    the replacement (a claim per partition), the others take it: the partition is loaded once
    more, not once per stream."""
    import logging
    import threading

    caplog.set_level(logging.WARNING, logger="adam_dask.data.serving._service")
    with serving(store, data_nodes=2, seed=8, batch_size=16) as (client, svc, pids):
        victim = svc.servers()[0]
        streams = [svc.stream(r, 3, 0, return_index=True) for r in range(3)]
        got: list[list] = [[next(s) for _ in range(2)] for s in streams]
        pids.update(freeze(client, [victim]))
        threads = [threading.Thread(target=lambda i=i: got[i].extend(streams[i])) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads)
        check_exactly_once([b for g in got for b in g], arrays, seed=8, epoch=0)
        assert all(s.stats()["recoveries"] >= 1 for s in streams if s.stats()["share_batches"])
    starts = [r for r in caplog.records if "starting DataServer generation" in r.getMessage()]
    assert len(starts) == 1, [r.getMessage() for r in starts]
