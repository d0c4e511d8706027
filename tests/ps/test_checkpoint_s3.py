"""Checkpoint write-back to S3 (moto's real server on 127.0.0.1), through an outage: writes
are retried with back-off and reported, nothing is dropped, and they land when S3 returns."""

from __future__ import annotations

import time

import dask
import numpy as np
import pytest

from adam_dask.ps import ParameterServer
from adam_dask.ps.checkpoint import read_checkpoint

N = 3 * 16384 + 5


@pytest.fixture
def own_s3():
    """A moto server of this test's own (it is stopped and restarted on the same port)."""
    import s3fs
    from moto.server import ThreadedMotoServer

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    opts = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": f"http://{host}:{port}",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5},
    }
    try:
        s3fs.S3FileSystem(**opts, skip_instance_cache=True).mkdir("adam-ps-outage")
    except FileExistsError:  # moto keeps its buckets in-process: an earlier test's is there
        pass
    state = {"server": srv, "port": port, "options": opts}
    yield state
    state["server"].stop()


# write-backs retried quickly, so an outage shows in a few seconds
FAST_RETRIES = {
    "adam.ps.writeback-interval": 0.1,
    "adam.ps.retry-base": 0.1,
    "adam.ps.retry-max": 0.5,
}


def checkpointed_then_outage(client, own_s3, url: str) -> ParameterServer:
    """A server on ``url`` with one push of ones in its checkpoint (epoch 1), then S3 stopped."""
    s = ParameterServer.create(
        client, size=N, shard_bytes=65536, checkpoint=url, storage_options=own_s3["options"]
    )
    s.push(np.ones(N, np.float32))
    s.flush(epoch=1)
    own_s3["server"].stop()  # S3 goes away
    return s


def s3_back(own_s3) -> None:
    """S3 returns on the same port (moto keeps its buckets in-process)."""
    from moto.server import ThreadedMotoServer

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=own_s3["port"], verbose=False)
    srv.start()
    own_s3["server"] = srv


def test_writeback_survives_s3_outage(ps_client, own_s3):
    url = "s3://adam-ps-outage/ckpt"
    with dask.config.set(FAST_RETRIES):
        s = checkpointed_then_outage(ps_client, own_s3, url)
    try:
        s.push(np.full(N, 2, np.float32))
        deadline = time.time() + 60
        while time.time() < deadline:
            st = s.stats()
            if st["writeback_errors"] >= 2:
                break
            time.sleep(0.2)
        assert st["writeback_errors"] >= 2  # retried and reported
        assert st["writeback_lag_versions"] == 1  # kept, not dropped
        s3_back(own_s3)
        s.flush(epoch=2)
        manifest, values = read_checkpoint(url, own_s3["options"])
        np.testing.assert_array_equal(values, np.full(N, 3, np.float32))
        assert manifest["epoch"] == 2 and manifest["versions"] == [2] * 4
        assert s.stats()["writeback_lag_versions"] == 0
    finally:
        s.close()


def test_pushes_go_on_through_an_s3_outage_and_land_once(ps_client, own_s3):
    """The replaying pusher keeps each push until the checkpoint holds it; while S3 is down
    nothing becomes durable, so past its byte budget it lets go of the pushes every copy holds
    (push() does not wait for storage), and they land when S3 is back."""
    url = "s3://adam-ps-outage/ckpt2"
    one = 4 * N  # bytes of one push's parts
    budget = {"adam.ps.replay-bytes": 3 * one, "adam.ps.failover-timeout": 10}
    with dask.config.set({**FAST_RETRIES, **budget}):
        s = checkpointed_then_outage(ps_client, own_s3, url)
        try:
            for _ in range(12):  # 4x the budget; each would wait out failover-timeout if held
                s.push(np.ones(N, np.float32))
            st = s.stats()
            deadline = time.monotonic() + 30  # the pushes may all be in before a write-back ran
            while st["writeback_errors"] < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
                st = s.stats()
            assert st["writeback_errors"] >= 1 and st["writeback_lag_versions"] >= 1
            assert 0 < st["held_bytes"] <= 3 * one + one
            s3_back(own_s3)
            s.flush(epoch=2)
            _, values = read_checkpoint(url, own_s3["options"])
            np.testing.assert_array_equal(values, np.full(N, 13, np.float32))
            np.testing.assert_array_equal(s.pull(), np.full(N, 13, np.float32))
        finally:
            s.close()


def test_restore_from_s3(ps_client, s3):
    base, opts = s3
    url = f"{base}/ckpt"
    s = ParameterServer.create(
        ps_client,
        size=N,
        shard_bytes=65536,
        checkpoint=url,
        storage_options=opts,
        meta={"spec": "fc10"},
    )
    try:
        rng = np.random.default_rng(0)
        s.push(rng.standard_normal(N).astype(np.float32))
        s.flush(epoch=5)
        expected = s.pull()
    finally:
        s.close()
    r = ParameterServer.restore(ps_client, url, storage_options=opts)
    try:
        np.testing.assert_array_equal(r.pull(), expected)
        assert r.epoch == 5 and r.meta == {"spec": "fc10"}
    finally:
        r.close()
