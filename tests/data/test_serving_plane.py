"""The images' data plane: batches from a DataServer to a stream on a socket of the stream's own
(a shared segment on one machine, bytes over TCP across machines), the same batches as the actor
path; a reader SIGKILLed leaves no segment; a DATA worker SIGKILLed, frozen or evicted (SIGTERM)
mid-stream loses and duplicates nothing, in a stream and in training."""

from __future__ import annotations

import contextlib
import signal
import time

import dask
import numpy as np
import pytest

import adam_dask
from adam_dask.cluster import DATA, TRAIN, workers_with_role
from adam_dask.data import Augment, DataService, load_arrays
from adam_dask.testing import (
    fit_in_background,
    freeze,
    hard_kill,
    join_fit,
    role_worker,
    synthetic_store,
    thaw,
)
from adam_dask.train.trainer import Trainer

N_TRAIN = 1024
AUG = Augment(rotation=8.0, translation=1.5)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return synthetic_store(tmp_path_factory.mktemp("plane"), n_train=N_TRAIN, n_test=256)


@pytest.fixture(scope="module")
def arrays(store):
    return load_arrays(store, "train")


@pytest.fixture(scope="module")
def cluster():
    with adam_dask.cluster.local(ps_nodes=0, data_nodes=2, trainers=1, memory_limit="2 GiB") as c:
        yield c


def stream_task(service, mode: str, epoch: int = 0):
    """On a TRAIN worker: one replica's whole share over ``mode``, and the stream's stats."""
    with dask.config.set({"adam.serving.data-plane": mode}):
        stream = service.stream(0, 1, epoch, return_index=True)
        return list(stream), stream.stats()


def segments(dask_worker=None) -> int:
    """Image-plane segments this process maps."""
    with open("/proc/self/maps") as f:
        return sum("memfd:adam-data" in line for line in f)


@pytest.mark.parametrize("augment", [False, AUG], ids=["stored", "augmented"])
def test_the_plane_gives_the_actor_paths_batches(cluster, store, augment):
    svc = DataService.create(cluster, store, augment=augment, seed=4, batch_size=40)
    try:
        got = {}
        for mode in ("dask", "auto", "tcp"):
            fut = cluster.submit(stream_task, svc, mode, resources={"TRAIN": 1}, pure=False)
            got[mode] = fut.result(timeout=120)
        n = len(got["dask"][0])
        assert n == sum(-(-len(b) // 40) for b in np.array_split(np.arange(N_TRAIN), 2))
        dask_path = {b[2].tobytes(): b for b in got["dask"][0]}
        for mode in ("auto", "tcp"):
            batches, stats = got[mode]
            assert stats["recoveries"] == 0, stats
            assert len(batches) == n
            for mine in batches:  # the same batches (images, labels, augmentation)
                theirs = dask_path[mine[2].tobytes()]
                for a, b in zip(mine, theirs):
                    assert a.dtype == b.dtype and a.shape == b.shape
                    np.testing.assert_array_equal(a, b)
            assert stats["transport"]["plane"] == n and stats["transport"]["dask"] == 0
            # on one machine every batch came through the shared segment, over TCP none did
            assert stats["transport"]["plane_shared"] == (n if mode == "auto" else 0)
        assert got["dask"][1]["transport"] == {"plane": 0, "dask": n, "local": 0, "plane_shared": 0}
        per_server = [s["transport"] for s in svc.stats()["servers"]]
        assert sum(t["plane"] for t in per_server) == 2 * n
        assert sum(t["dask"] for t in per_server) == n
    finally:
        svc.close()


def test_a_tls_cluster_serves_its_batches_over_tls_on_the_plane(store):
    """A ``tls://`` cluster: the image plane's TCP connections are TLS with Dask's own
    certificates (forced onto TCP: on one machine the Unix path would carry them), the same
    batches as the actor path, none of them as an actor call."""
    with adam_dask.cluster.local(
        ps_nodes=0, data_nodes=1, trainers=1, memory_limit="2 GiB", tls=True
    ) as c:
        assert c.scheduler.address.startswith("tls://")
        svc = DataService.create(c, store, seed=4, batch_size=40)
        try:
            got = {}
            for mode in ("dask", "tcp"):
                fut = c.submit(stream_task, svc, mode, resources={"TRAIN": 1}, pure=False)
                got[mode] = fut.result(timeout=120)
        finally:
            svc.close()
    batches, stats = got["tcp"]
    theirs = {b[2].tobytes(): b for b in got["dask"][0]}
    assert len(batches) == len(theirs) > 0
    for mine in batches:
        for a, b in zip(mine, theirs[mine[2].tobytes()]):
            np.testing.assert_array_equal(a, b)
    assert stats["transport"]["plane"] == len(batches) and stats["transport"]["dask"] == 0


def test_a_bad_plane_setting_is_one_clear_error(cluster, store):
    from adam_dask.errors import ConfigError

    svc = DataService.create(cluster, store, augment=False, seed=0, batch_size=64)
    try:
        with dask.config.set({"adam.serving.data-plane": "rdma"}):
            with pytest.raises(ConfigError, match=r"adam\.serving\.data-plane is 'rdma'"):
                svc.stream(0, 1, 0)
    finally:
        svc.close()


def reader_task(service, go: str):
    """Opens a stream over the plane, reads two batches, says so, and waits to be killed."""
    from distributed import Event

    stream = service.stream(0, 1, 0, return_index=True)
    next(stream), next(stream)
    Event(f"{go}-ready").set()
    Event(go).wait(timeout=120)
    return stream.stats()


def test_a_sigkilled_reader_leaves_no_segment(store):
    from distributed import Event

    with adam_dask.cluster.local(
        ps_nodes=0, data_nodes=1, trainers=1, memory_limit="2 GiB"
    ) as client:
        svc = DataService.create(client, store, augment=AUG, seed=1, batch_size=32)
        try:
            data = workers_with_role(client, DATA)
            task = client.submit(reader_task, svc, "reader", resources={"TRAIN": 1}, pure=False)
            assert Event("reader-ready", client=client).wait(timeout=120)
            assert not task.done()  # the reader waits, its stream open
            assert sum(client.run(segments, workers=data).values()) == 1  # the reader's arena
            assert svc.stats()["servers"][0]["streams"] == 1
            hard_kill(client, workers_with_role(client, TRAIN))  # the reader's only worker
            deadline = time.monotonic() + 30
            while (
                sum(client.run(segments, workers=data).values())
                or svc.stats()["servers"][0]["streams"]
            ):
                assert time.monotonic() < deadline, "the dead reader's segment is still mapped"
                time.sleep(0.2)
        finally:
            svc.close()


def replica_task(service, before: int, go: str):
    """On a TRAIN worker: ``before`` batches, say so, wait for ``go``, the rest."""
    from distributed import Event

    stream = service.stream(0, 1, 0, return_index=True)
    got = [next(stream) for _ in range(before)]
    plane_before = stream.stats()["transport"]["plane"]
    Event(f"{go}-ready").set()
    Event(go).wait(timeout=120)
    got.extend(stream)
    return got, plane_before, stream.stats()


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_data_worker_lost_mid_stream_over_the_plane(store, arrays, fault):
    from distributed import Event

    images, labels = arrays
    with adam_dask.cluster.local(
        ps_nodes=0, data_nodes=2, trainers=1, memory_limit="2 GiB"
    ) as client:
        svc = DataService.create(client, store, augment=AUG, seed=6, batch_size=32)
        pids: dict[str, int] = {}
        try:
            victim = svc.servers()[0]
            task = client.submit(replica_task, svc, 6, "go", resources={"TRAIN": 1}, pure=False)
            assert Event("go-ready", client=client).wait(timeout=120)
            if fault == "sigkill":  # from outside, as a machine failure
                hard_kill(client, [victim], wait=False)
            else:  # frozen past probe-after + probe-timeout, and kept frozen
                pids.update(freeze(client, [victim]))
            Event("go", client=client).set()
            got, plane_before, stats = task.result(timeout=300)
        finally:
            thaw(pids)
            svc.close()
    idx = np.concatenate([b[2] for b in got])
    assert len(idx) == N_TRAIN and np.array_equal(np.sort(idx), np.arange(N_TRAIN))  # once each
    for x, y, i in got:
        assert np.array_equal(y, labels[i])
        np.testing.assert_array_equal(x, AUG.apply(images[i], i, seed=6, epoch=0))
    assert plane_before == 6  # the batches before the fault came over the plane
    assert stats["images"] == stats["share_images"] == N_TRAIN
    assert stats["recoveries"] >= 1
    t = stats["transport"]
    assert t["dask"] == 0 and t["plane"] + t["local"] == stats["batches"]
    assert t["plane"] > plane_before  # the replacement served over the plane too
    if fault == "sigstop":
        assert stats["unanswered"] >= 1 and stats["call_timeouts"] == 0


def _fit_under_way(store, client):
    """A 2-epoch fit of a small net in the background, returned once its replica has trained
    128 images of epoch 0: (trainer, thread, box)."""
    t = Trainer(
        store,
        model="fc32,fc10",
        client=client,
        lr=0.05,
        push_every=64,
        batch_size=8,
        progress=False,
        slow_replicas={0: 0.05},
    )
    th, box = fit_in_background(t, epochs=2)
    deadline = time.time() + 300
    while not (t.epoch == 0 and sum(t._progress_state.values()) >= 128):
        assert time.time() < deadline and "error" not in box, box.get("error")
        time.sleep(0.05)
    return t, th, box


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_training_goes_on_when_a_data_worker_is_lost(store, fault):
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=2, trainers=1, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        t, th, box = _fit_under_way(store, client)
        served = svc_plane_batches(t.dataservice)
        assert served > 0  # the replica reads over the plane
        victim = t.dataservice.servers()[0]
        pids: dict[str, int] = {}
        try:
            if fault == "sigkill":
                hard_kill(client, [victim], wait=False)
            else:
                pids.update(freeze(client, [victim]))
            th.join(timeout=300)
        finally:
            thaw(pids)
        assert not th.is_alive()
        assert "error" not in box, box.get("error")
        h = box["history"]
        assert h.column("images_applied") == [N_TRAIN, N_TRAIN]  # none lost, none twice
        t.close()


def svc_plane_batches(service) -> int:
    return sum(s.get("transport", {}).get("plane", 0) for s in service.stats()["servers"])


def _wait_data_workers(client, n: int, timeout: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(found := workers_with_role(client, DATA)) != n:
        assert time.monotonic() < deadline, f"expected {n} DATA workers, found {found}"
        time.sleep(0.2)
    return found


@contextlib.contextmanager
def _evictable_data_worker(client):
    """The cluster's one DATA worker in a ``dask worker`` process of its own; yields
    ``evict(meanwhile, then)``: SIGTERM to it from this process, as the kubelet sends, then
    ``meanwhile()``, then, once it exited, ``then()`` and a replacement DATA worker. Both
    processes end with the block."""
    scheduler = client.scheduler.address
    procs = [role_worker(scheduler, DATA, name="data-evicted")]

    def evict(meanwhile=lambda: None, then=lambda: None) -> None:
        procs[0].send_signal(signal.SIGTERM)
        meanwhile()
        assert procs[0].wait(timeout=60) is not None  # its worker closed and it exited
        then()
        procs.append(role_worker(scheduler, DATA, name="data-replacement"))

    try:
        _wait_data_workers(client, 1)
        yield evict
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def test_a_data_worker_evicted_mid_stream_is_recovered_from(store, arrays):
    """SIGTERM to a DATA worker's process (a pod evicted), sent from this process mid-stream,
    and a replacement started once it is gone: the stream goes on, every image once (before,
    a graceful close of its worker closed the stream with 'the DataService was closed')."""
    from distributed import Event

    images, labels = arrays
    with adam_dask.cluster.local(
        ps_nodes=0, data_nodes=0, trainers=1, memory_limit="2 GiB"
    ) as client:
        with _evictable_data_worker(client) as evict:
            svc = DataService.create(client, store, augment=AUG, seed=6, batch_size=32)
            task = client.submit(replica_task, svc, 6, "ev", resources={"TRAIN": 1}, pure=False)
            assert Event("ev-ready", client=client).wait(timeout=120)
            evict(Event("ev", client=client).set)  # the reader goes on while its worker closes
            got, plane_before, stats = task.result(timeout=300)
            svc.close()
    idx = np.concatenate([b[2] for b in got])
    assert len(idx) == N_TRAIN and np.array_equal(np.sort(idx), np.arange(N_TRAIN))  # once each
    for x, y, i in got:
        assert np.array_equal(y, labels[i])
        np.testing.assert_array_equal(x, AUG.apply(images[i], i, seed=6, epoch=0))
    assert plane_before == 6
    assert stats["images"] == stats["share_images"] == N_TRAIN
    # the stream recovered, or its server served it all within the eviction's grace
    assert stats["recoveries"] >= 1 or stats["transport"]["plane"] == stats["batches"]


def test_training_goes_on_when_a_data_worker_is_evicted(store):
    """The same eviction under a fit: the run completes and the parameter server applied every
    image of each epoch once."""
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=0, trainers=1, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        with _evictable_data_worker(client) as evict:
            t, th, box = _fit_under_way(store, client)
            evict()
            join_fit(th, client, 300)
            assert "error" not in box, box.get("error")
            h = box["history"]
            assert h.column("images_applied") == [N_TRAIN, N_TRAIN]  # none lost, none twice
            assert h.column("images_retrained") == [0, 0]
            t.close()


def slow_reader_task(service, go: str, every: float = 0.1):
    """On a TRAIN worker: a stream read one batch per ``every`` seconds (a replica training),
    returning to a DATA worker every 0.5 s; until ``go``, a few batches only; sets
    ``{go}-local`` once it serves a batch itself (its DataServer lost). With 24 batches
    left and the partition not moved yet, it waits for ``{go}-joined`` (the replacement worker
    is in the cluster; under load it can take longer than the epoch to start) and then reads
    one batch per second while the partition is still served here."""
    from distributed import Event

    with dask.config.set({"adam.serving.return-interval": 0.5}):
        stream = service.stream(0, 1, 0, batch_size=8, return_index=True)
        got = [next(stream) for _ in range(4)]
        Event(f"{go}-ready").set()
        Event(go).wait(timeout=120)
        moved_at = None
        told = False
        for batch in stream:
            got.append(batch)
            if stream.local_batches and not told:
                told = True
                Event(f"{go}-local").set()
            if moved_at is None and stream.stats()["returns"]:
                moved_at = len(got)
            if moved_at is None and len(got) >= N_TRAIN // 8 - 24:
                Event(f"{go}-joined").wait(timeout=120)
                time.sleep(1.0)
            else:
                time.sleep(every)
        return got, moved_at, stream.stats()


def test_an_evicted_data_workers_partition_moves_to_its_replacement(store, arrays):
    """The only DATA worker evicted mid-stream: the stream serves its partition itself, then
    moves it to a DataServer it starts on the replacement worker in the background, and takes
    its batches from there for the rest of the epoch; every image once. The replacement is
    started once the stream serves locally: started earlier, a stream that notices the loss
    late (a slow ping beside busy processes) goes to it at once, with nothing to move back."""
    from distributed import Event

    with adam_dask.cluster.local(
        ps_nodes=0, data_nodes=0, trainers=1, memory_limit="2 GiB"
    ) as client:
        with _evictable_data_worker(client) as evict:
            svc = DataService.create(client, store, augment=AUG, seed=7, batch_size=8)
            task = client.submit(slow_reader_task, svc, "mv", resources={"TRAIN": 1}, pure=False)
            assert Event("mv-ready", client=client).wait(timeout=120)

            def served_locally() -> None:
                assert Event("mv-local", client=client).wait(timeout=120)

            # the reader goes on while its worker closes, then serves the partition itself
            evict(Event("mv", client=client).set, served_locally)
            (new,) = _wait_data_workers(client, 1)
            Event("mv-joined", client=client).set()
            got, moved_at, stats = task.result(timeout=300)
            assert svc.generation(0) >= 1 and svc.servers() == [new]
            svc.close()
    images, labels = arrays
    idx = np.concatenate([b[2] for b in got])
    assert len(idx) == N_TRAIN and np.array_equal(np.sort(idx), np.arange(N_TRAIN))
    for x, y, i in got:
        assert np.array_equal(y, labels[i])
        np.testing.assert_array_equal(x, AUG.apply(images[i], i, seed=7, epoch=0))
    assert stats["recoveries"] >= 1 and stats["returns"] == 1, stats
    assert moved_at is not None and moved_at < len(got), (moved_at, stats)
    # after the move the batches came from the new DataServer, not from this process
    assert stats["local_batches"] < moved_at, (moved_at, stats)
