"""Data serving: DataServer actors on DATA workers, BatchStreams, exactly-once epochs, early
stops, local serving, the cache bound, S3, bad stores, and a DataServer whose worker dies."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import zarr

import adam_dask
from adam_dask.data import Augment, DataService, load_arrays
from adam_dask.data.ingest import ingest
from adam_dask.errors import ClusterError, ConfigError, DatasetError
from adam_dask.testing import hard_kill as kill_workers
from adam_dask.testing import write_mnist_like

N_TRAIN, N_TEST = 1000, 100
AUG = Augment(rotation=8.0, translation=1.5, elastic_alpha=20.0, elastic_sigma=4.0)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("serving")
    src = write_mnist_like(root / "src", N_TRAIN, N_TEST)
    ingest(str(src), str(root / "store"), chunk_images=64, shard_images=128)
    return str(root / "store")


@pytest.fixture(scope="module")
def arrays(store):
    return load_arrays(store, "train")


@pytest.fixture(scope="module")
def cluster():
    """Two DATA workers (two partitions) and one TRAIN worker."""
    with adam_dask.cluster.local(ps_nodes=0, data_nodes=2, trainers=1, memory_limit="2 GiB") as c:
        yield c


def drain(stream):
    xs, ys, idx = [], [], []
    for x, y, i in stream:
        xs.append(x), ys.append(y), idx.append(i)
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(idx)


def check_batch(x, y, idx, arrays, aug, seed, epoch):
    images, labels = arrays
    assert x.dtype == np.float32 and x.shape == (len(idx), 1, 28, 28)
    assert y.dtype == np.int64 and np.array_equal(y, labels[idx])
    want = (aug or Augment()).apply(images[idx], idx, seed=seed, epoch=epoch)
    np.testing.assert_array_equal(x, want)


def replica_task(service, replica, replicas, epoch):
    """Runs on a TRAIN worker: the pickled service streams peer-to-peer from the DataServers."""
    stream = service.stream(replica, replicas, epoch, return_index=True)
    idx = [i for _, _, i in stream]
    return np.concatenate(idx), stream.stats()


# -- exactly once --------------------------------------------------------------------------------


def test_every_image_exactly_once_per_epoch(cluster, store, arrays):
    svc = DataService.create(cluster, store, augment=AUG, seed=3, batch_size=48)
    try:
        assert not svc.local and svc.layout.partitions == 2
        orders = []
        for epoch in (0, 1):
            # replica 0 in a task on the TRAIN worker, 1 and 2 here, all at the same time
            fut = cluster.submit(replica_task, svc, 0, 3, epoch, resources={"TRAIN": 1}, pure=False)
            streams = [svc.stream(r, 3, epoch, return_index=True) for r in (1, 2)]
            assert [len(s) for s in streams] == [8, 8]  # ceil(166/48) + ceil(167/48)
            got = [drain(s) for s in streams]
            idx0, stats0 = fut.result()
            all_idx = np.concatenate([idx0] + [g[2] for g in got])
            assert len(all_idx) == N_TRAIN and np.array_equal(np.sort(all_idx), np.arange(N_TRAIN))
            assert stats0["images"] == len(idx0) and stats0["recoveries"] == 0
            for (x, y, idx), s in zip(got, streams):
                check_batch(x, y, idx, arrays, AUG, 3, epoch)
                st = s.stats()
                assert st["images"] == s.images == len(idx)
                assert st["batches"] == len(s) and 0.0 <= st["stall_fraction"] <= 1.0
                assert st["wait_seconds"] >= 0.0
            orders.append(all_idx)
        assert not np.array_equal(orders[0], orders[1])  # a new order every epoch
        stats = svc.stats()
        assert stats["images_served"] == 2 * N_TRAIN
        assert [s["images_served"] for s in stats["servers"]] == [
            2 * (b - a) for a, b in (svc.layout.partition(p) for p in (0, 1))
        ]
        assert all(s["streams"] == 0 for s in stats["servers"])  # finished streams released
    finally:
        svc.close()


def test_local_serving_matches_the_servers(cluster, store, arrays):
    """With no DATA workers the stream serves itself; the same images and augmentation."""
    local = DataService.create(None, store, augment=AUG, seed=3, batch_size=100)
    assert local.local
    x, y, idx = drain(local.stream(0, 1, epoch=2, return_index=True))
    assert np.array_equal(np.sort(idx), np.arange(N_TRAIN))
    check_batch(x, y, idx, arrays, AUG, 3, 2)
    # no augmentation: exactly the stored pixels
    plain = DataService.create(None, store, augment=False, batch_size=256)
    x, y, idx = drain(plain.stream(1, 2, epoch=0, return_index=True))
    check_batch(x, y, idx, arrays, None, 0, 0)
    assert len(idx) == N_TRAIN // 2


# -- early stops and abandoned consumers ---------------------------------------------------------


def test_a_consumer_that_stops_does_not_block_the_others(cluster, store):
    svc = DataService.create(cluster, store, augment=AUG, batch_size=32, buffer_batches=2)
    try:
        quitter = svc.stream(0, 2, 0)
        next(quitter)  # takes one batch, then never reads again
        other = svc.stream(1, 2, 0, return_index=True)
        _, _, idx = drain(other)
        assert len(idx) == other.images == N_TRAIN // 2
        assert any(s["streams"] == 1 for s in svc.stats()["servers"])  # the quitter's state
        quitter.close()  # the 75% rule stops a straggler at once
        assert list(quitter) == []
        deadline = time.monotonic() + 10
        while any(s["streams"] for s in svc.stats()["servers"]):
            assert time.monotonic() < deadline, svc.stats()
            time.sleep(0.05)
        assert quitter.stats()["batches"] == 1
    finally:
        svc.close()


def test_a_stream_dropped_for_idleness_is_reopened(cluster, store):
    import dask

    with dask.config.set({"adam.serving.idle-timeout": 0.3}):
        svc = DataService.create(cluster, store, augment=None, batch_size=100, buffer_batches=2)
    try:
        stream = svc.stream(0, 1, 0, return_index=True)
        first = [next(stream)[2] for _ in range(2)]
        deadline = time.monotonic() + 20  # the servers drop the idle stream
        while any(s["streams"] for s in svc.stats()["servers"]):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        rest = [i for _, _, i in stream]
        idx = np.concatenate(first + rest)
        assert np.array_equal(np.sort(idx), np.arange(N_TRAIN))
    finally:
        svc.close()


def test_closing_the_service_ends_its_streams_with_a_clear_error(cluster, store):
    svc = DataService.create(cluster, store, augment=None, batch_size=50)
    stream = svc.stream(0, 1, 0)
    next(stream)
    svc.close()
    with pytest.raises(ClusterError, match="closed"):
        for _ in stream:
            pass
    with pytest.raises(ClusterError, match="closed"):
        svc.stream(0, 1, 0)


def test_cache_bound_reads_chunks_on_demand(cluster, store, arrays):
    chunk_bytes = 64 * 28 * 28
    svc = DataService.create(
        cluster, store, augment=None, batch_size=40, cache_bytes=4 * chunk_bytes
    )
    try:
        assert svc.layout.window_chunks == 2
        got = [drain(svc.stream(r, 2, 1, return_index=True)) for r in range(2)]
        idx = np.concatenate([g[2] for g in got])
        assert np.array_equal(np.sort(idx), np.arange(N_TRAIN))
        for x, y, i in got:
            check_batch(x, y, i, arrays, None, 0, 1)
        for s in svc.stats()["servers"]:
            # a batch may pin the chunks it needs on top of the bound
            assert s["cached_bytes"] <= 4 * chunk_bytes + 40 * 28 * 28
            assert s["chunk_reads"] >= 4
    finally:
        svc.close()


def test_stream_arguments_are_checked(cluster, store):
    svc = DataService.create(None, store)
    with pytest.raises(ConfigError, match="replica=2"):
        svc.stream(2, 2, 0)
    with pytest.raises(ConfigError, match="epoch"):
        svc.stream(0, 1, -1)
    with pytest.raises(ConfigError, match="batch_size"):
        DataService.create(None, store, batch_size=0)


def test_serving_from_s3(cluster, s3, tmp_path):
    prefix, opts = s3
    src = write_mnist_like(tmp_path / "src", 300, 20)
    url = f"{prefix}/mnist.zarr"
    ingest(str(src), url, dest_storage_options=opts, chunk_images=64, shard_images=128)
    svc = DataService.create(cluster, url, storage_options=opts, augment=AUG, batch_size=50)
    try:
        idx = np.concatenate([drain(svc.stream(r, 2, 0, return_index=True))[2] for r in range(2)])
        assert np.array_equal(np.sort(idx), np.arange(300))
    finally:
        svc.close()
    images, labels = load_arrays(url, "test", opts)
    assert images.shape == (20, 28, 28) and labels.dtype == np.int64


# -- bad stores ---------------------------------------------------------------------------------------


def _bad_store(path: Path, images: np.ndarray | None, labels: np.ndarray | None) -> str:
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    g = root.create_group("train")
    if images is not None:
        g.create_array("images", data=images, chunks=(64,) + images.shape[1:])
    if labels is not None:
        g.create_array("labels", data=labels, chunks=(64,))
    g.attrs.update({"classes": [str(i) for i in range(10)], "complete": True})
    return str(path)


@pytest.mark.parametrize("case", ["no-images", "no-labels", "mismatch"])
def test_a_bad_store_is_named_in_a_clear_error(cluster, tmp_path, case):
    images = np.zeros((100, 28, 28), np.uint8)
    labels = np.zeros(100 if case != "mismatch" else 90, np.uint8)
    url = _bad_store(
        tmp_path / "bad",
        None if case == "no-images" else images,
        None if case == "no-labels" else labels,
    )
    with pytest.raises(DatasetError) as err:
        DataService.create(cluster, url)
    assert url in str(err.value) and err.value.url == url


@pytest.mark.parametrize("where", ["cluster", "local"])
def test_an_unreadable_chunk_is_named_in_a_clear_error(cluster, tmp_path, where):
    src = write_mnist_like(tmp_path / "src", 300, 20)
    url = str(tmp_path / "store")
    ingest(str(src), url, chunk_images=64, shard_images=128)
    shard = Path(url) / "train" / "images" / "c" / "1" / "0" / "0"  # images 128..255
    assert shard.exists()
    shard.write_bytes(b"\x00garbage" * 100)
    svc = DataService.create(cluster if where == "cluster" else None, url, batch_size=50)
    try:
        with pytest.raises(DatasetError) as err:
            for r in range(2):
                for _ in svc.stream(r, 2, 0):
                    pass
        assert url in str(err.value) and "ingest" in str(err.value)
    finally:
        svc.close()


# -- a DataServer whose worker dies -----------------------------------------------------------------


@pytest.mark.parametrize("recovery", ["new-actor", "local-fallback"])
def test_a_dead_data_server_is_replaced_and_the_epoch_completes(store, arrays, recovery):
    import dask

    # "local-fallback": no replacement actor can start in time, so the stream serves the rest
    # of the dead server's partition itself
    timeout = 30 if recovery == "new-actor" else 1e-3
    with (
        adam_dask.cluster.local(
            ps_nodes=0, data_nodes=2, trainers=0, memory_limit="2 GiB"
        ) as client,
        dask.config.set({"adam.serving.recover-timeout": timeout}),
    ):
        svc = DataService.create(
            client, store, augment=AUG, seed=1, batch_size=25, buffer_batches=2
        )
        try:
            victim = svc.servers()[0]
            assert victim in adam_dask.cluster.workers_with_role(client, "DATA")
            streams = [svc.stream(r, 2, 0, return_index=True) for r in range(2)]
            got = [[], []]
            for r, s in enumerate(streams):  # both consumers are part-way through
                for _ in range(5):
                    got[r].append(next(s))
            kill_workers(client, [victim])
            for r, s in enumerate(streams):
                got[r].extend(s)
            idx = np.concatenate([b[2] for g in got for b in g])
            assert len(idx) == N_TRAIN and np.array_equal(np.sort(idx), np.arange(N_TRAIN))
            for g in got:
                x = np.concatenate([b[0] for b in g])
                y = np.concatenate([b[1] for b in g])
                check_batch(x, y, np.concatenate([b[2] for b in g]), arrays, AUG, 1, 0)
            assert sum(s.stats()["recoveries"] for s in streams) >= 1
            later = svc.stream(0, 1, 1, return_index=True)
            _, _, idx = drain(later)
            assert np.array_equal(np.sort(idx), np.arange(N_TRAIN))
            if recovery == "new-actor":  # the next epoch finds the new generation at once
                assert later.stats()["recoveries"] == 0
                assert svc.generation(0) >= 1
        finally:
            svc.close()
