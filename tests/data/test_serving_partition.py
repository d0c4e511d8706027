"""The Dask-free core of data serving: the partition layout and a partition server's messages
(a batch, the end, an expired stream, a closed server, a store error), without a cluster."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adam_dask.data import Augment, load_arrays
from adam_dask.data.augment import to_float
from adam_dask.data.ingest import ingest
from adam_dask.data.serving._layout import PartitionLayout, batch_plan
from adam_dask.data.serving._messages import (
    Batch,
    End,
    ServerClosed,
    ServingError,
    StreamExpired,
)
from adam_dask.data.serving._partition import PartitionServer, ServerSettings
from adam_dask.errors import ConfigError, InputShapeError
from adam_dask.testing import synthetic_store, write_mnist_like

N = 600


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return synthetic_store(tmp_path_factory.mktemp("partition"), n_train=N, n_test=32)


def server(store: str, p: int = 0, partitions: int = 2, **kw) -> PartitionServer:
    layout = PartitionLayout(N, 256, partitions)
    return PartitionServer(
        store, "train", None, layout, p, ServerSettings.from_config(augment=None, **kw)
    )


def take_all(srv: PartitionServer, sid: str) -> list[Batch]:
    out = []
    while isinstance(msg := srv.take(sid, timeout=60), Batch):
        out.append(msg)
    assert isinstance(msg, End)
    return out


@pytest.mark.parametrize("window", [None, 1])
def test_shares_cover_every_image_once_in_a_new_order_every_epoch(window):
    lay = PartitionLayout(n=1000, chunk=64, partitions=3, window_chunks=window)
    orders = []
    for epoch in (0, 1):
        got = np.concatenate(
            [lay.share(p, epoch, seed=4, replica=r, replicas=4) for p in range(3) for r in range(4)]
        )
        assert np.array_equal(np.sort(got), np.arange(1000))
        orders.append(got)
    assert not np.array_equal(orders[0], orders[1])
    counts, schedule = batch_plan(lay, replica=1, replicas=4, epoch=0, batch_size=10, seed=4)
    assert [schedule.count(p) for p in range(3)] == counts
    assert sum(counts) == sum(-(-lay.share_size(p, 1, 4) // 10) for p in range(3))


def test_a_reopened_stream_serves_only_the_batches_not_yet_delivered(store):
    images, labels = load_arrays(store, "train")
    srv = server(store)
    try:
        assert srv.open_stream("a", 0, 0, 1, 32) == 8  # 256 images
        full = take_all(srv, "a")
        assert [b.k for b in full] == list(range(8))
        done = [0, 2, 3, 7]
        n = srv.open_stream("b", 0, 0, 1, 32, done)
        rest = take_all(srv, "b")
        assert n == len(rest) == len(full) - len(done)
        assert sorted(done + [b.k for b in rest]) == [b.k for b in full]
        by_k = {b.k: b for b in full}
        for b in rest:  # the same images in the same batch, whoever serves it
            assert np.array_equal(b.idx, by_k[b.k].idx)
            assert np.array_equal(b.y, labels[b.idx])
            assert b.x.dtype == np.uint8 and np.array_equal(b.x[..., 0], images[b.idx])
    finally:
        srv.close()


def test_unknown_streams_expire_and_a_closed_server_says_so(store):
    srv = server(store, p=1)
    assert isinstance(srv.try_take("nobody"), StreamExpired)
    srv.open_stream("a", 0, 0, 1, 64)
    srv.close()
    msg = srv.try_take("a")
    assert isinstance(msg, ServerClosed) and "shut down" in str(msg.exception())


def test_an_unreadable_chunk_is_a_serving_error_naming_the_store(tmp_path):
    src = write_mnist_like(tmp_path / "src", N, 20)
    url = str(tmp_path / "store")
    ingest(str(src), url, chunk_images=64, shard_images=128)
    (Path(url) / "train" / "images" / "c" / "1" / "0" / "0").write_bytes(b"\x00garbage" * 100)
    layout = PartitionLayout(N, 64, 1)
    srv = PartitionServer(url, "train", None, layout, 0, ServerSettings.from_config(augment=None))
    try:
        srv.open_stream("a", 0, 0, 1, 600)  # one batch: every chunk, the damaged one too
        msg = srv.take("a", timeout=60)
        assert isinstance(msg, ServingError) and msg.url == url
        assert "ingest" in str(msg.exception())
    finally:
        srv.close()


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="threads"):
        ServerSettings.from_config(augment=None, threads=0)
    assert ServerSettings.from_config(augment=Augment()).augment is None  # identity: none


def test_to_float_is_the_pixel_divided_by_255():
    px = np.arange(256, dtype=np.uint8)
    assert np.array_equal(to_float(px), px.astype(np.float32) / np.float32(255))
    with pytest.raises(InputShapeError, match="uint8"):
        to_float(px.astype(np.float32))


EXIT_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from adam_dask.data.serving._layout import PartitionLayout
from adam_dask.data.serving._partition import PartitionServer, ServerSettings
layout = PartitionLayout(int(sys.argv[2]), 64, 1, window_chunks=1)  # streamed: reads go on
srv = PartitionServer(sys.argv[1], "train", None, layout, 0, ServerSettings.from_config(augment=None))
srv.open_stream("a", 0, 0, 1, 8)
assert srv.take("a", timeout=60).k == 0
sys.exit(0)  # the producers are still at work, reading ahead
"""


def _run_quietly(script: str, store: str) -> str:
    """Run ``script`` in a fresh Python on ``store``: it exits 0 and writes no traceback and no
    failure; returns its stderr."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", script, store, str(N)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "failed" not in proc.stderr, proc.stderr[-2000:]
    return proc.stderr


def test_a_process_ending_mid_stream_closes_its_partitions_first(store):
    """A worker process that ends while its partitions serve (closed by its nanny, a job
    stopped by SIGTERM) closes them at exit, before the exit stops the thread pools their reads
    run on: no read fails and no traceback is written (it did about one run in three)."""
    err = _run_quietly(EXIT_SCRIPT, store)
    assert "closing 1 data partition(s) at exit" in err


LATE_SCRIPT = """
import atexit, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from adam_dask.data.serving._layout import PartitionLayout
from adam_dask.data.serving._partition import PartitionServer, ServerSettings
from adam_dask.errors import ClusterError
layout = PartitionLayout(int(sys.argv[2]), 64, 1, window_chunks=1)
settings = ServerSettings.from_config(augment=None)
first = PartitionServer(sys.argv[1], "train", None, layout, 0, settings)
first.open_stream("a", 0, 0, 1, 8)
assert first.take("a", timeout=60).k == 0

def late():  # a daemon thread still at work after the exit closed the partitions
    try:
        srv = PartitionServer(sys.argv[1], "train", None, layout, 0, settings)
    except ClusterError as exc:
        print("refused:", exc, file=sys.stderr)
        return
    srv.open_stream("b", 0, 0, 1, 8)
    print("started:", srv.take("b", timeout=60).k, file=sys.stderr)

atexit.register(late)  # runs after the threading exit hooks, which closed the partitions
sys.exit(0)
"""


def test_a_partition_asked_for_while_the_process_ends_is_refused_not_read(store):
    """A replica task's thread can go on to its next stream after the exit closed the
    partitions; a partition started then would read while zarr stops its pool, and its failed
    read would blame the store ("ingest it again"). It is refused, and says why."""
    err = _run_quietly(LATE_SCRIPT, store)
    assert "refused: the DataServer of partition 0 was not started: this process is ending" in (
        err
    ), err[-2000:]
