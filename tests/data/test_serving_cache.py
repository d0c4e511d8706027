"""A partition server without Dask: a partition that fits the cache is one array and a batch one
gather, the same images as the chunk-by-chunk path of one that does not; and readers blocked in
take() on streams of their own (each waiting on its stream's condition) get every batch of
their stream, in order, once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from adam_dask.data import load_arrays
from adam_dask.data.datasets import open_split
from adam_dask.data.ingest import ingest
from adam_dask.data.serving._cache import ChunkCache
from adam_dask.data.serving._layout import PartitionLayout
from adam_dask.data.serving._messages import Batch, End, StreamExpired
from adam_dask.data.serving._partition import PartitionServer, ServerSettings
from adam_dask.testing import write_mnist_like

N_TRAIN = 600


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("cache")
    src = write_mnist_like(root / "src", N_TRAIN, 50)
    ingest(str(src), str(root / "store"), chunk_images=64, shard_images=128)
    return str(root / "store")


def test_a_partition_that_fits_is_one_gather_with_the_chunks_images(store):
    split = open_split(store, "train")
    images, _ = load_arrays(store, "train")
    start, stop = 128, N_TRAIN  # a chunk-aligned partition, its last chunk short
    image_bytes = 28 * 28
    whole = ChunkCache(split, start, stop, cache_bytes=(stop - start) * image_bytes, readers=2)
    chunked = ChunkCache(split, start, stop, cache_bytes=3 * 64 * image_bytes, readers=2)
    try:
        rng = np.random.default_rng(0)
        idx = rng.permutation(np.arange(start, stop))[:100]
        expected = images[idx].reshape(-1, 28, 28, 1)
        # before every chunk is in, both take the chunk by chunk path
        np.testing.assert_array_equal(whole.get(idx), expected)
        for cid in whole.chunk_ids:
            whole.load(cid)
        assert whole._complete and not chunked._complete
        for _ in range(3):
            idx = rng.permutation(np.arange(start, stop))[:64]
            out = np.empty((64, 28, 28, 1), np.uint8)
            got = whole.get(idx, out=out)
            assert got is out
            np.testing.assert_array_equal(got, images[idx].reshape(-1, 28, 28, 1))
            np.testing.assert_array_equal(chunked.get(idx), got)
        assert chunked._whole is None  # the bounded one reads, keeps and evicts by chunk
        assert whole.cached_images == stop - start
    finally:
        whole.close()
        chunked.close()


def test_a_blocked_take_gets_its_own_streams_batch(store):
    split = open_split(store, "train")
    layout = PartitionLayout(len(split), split.chunk_images, 1)
    settings = ServerSettings.from_config(augment=None, seed=1, buffer_batches=2, threads=2)
    server = PartitionServer(store, "train", None, layout, 0, settings)
    try:
        server.wait_ready(60)
        n = {sid: server.open_stream(sid, 0, r, 3, 16) for r, sid in enumerate("abc")}
        got: dict[str, list] = {sid: [] for sid in n}

        def read(sid: str) -> None:
            for _ in range(n[sid]):
                got[sid].append(server.take(sid, timeout=60))

        readers = [threading.Thread(target=read, args=(sid,)) for sid in n]
        for t in readers:
            t.start()
        for t in readers:
            t.join(120)
        for sid, batches in got.items():  # every batch of every stream, in order, once
            assert [b.k for b in batches] == list(range(n[sid]))
        idx = np.concatenate([b.idx for bs in got.values() for b in bs])
        assert sorted(idx.tolist()) == list(range(len(split)))
        assert isinstance(server.take("a", timeout=5), End)
        server.open_stream("d", 1, 0, 1, 16)
        assert isinstance(server.take("d", timeout=60), Batch)
        assert server.close_stream("d")
        assert isinstance(server.take("d", timeout=5), StreamExpired)
    finally:
        server.close()
