"""The checkpoint a run writes by default, and training through storage outages.

A Trainer given no checkpoint writes back to its run folder (``adam.train.runs-dir``), so a run
that loses every copy of a shard (SIGKILL of every holder, sent from the test process) goes on
from it with every image applied. An epoch's end waits for the copies, not for storage: S3
(moto's server in a process of its own, on 127.0.0.1) stopped with SIGSTOP across epochs' ends
for longer than ``adam.ps.flush-timeout`` holds nothing up, and the checkpoint catches up when
it is continued (SIGCONT)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import dask
import numpy as np
import pytest

import adam_dask
from adam_dask.errors import ConfigError, StorageError
from adam_dask.ps import ParameterServer
from adam_dask.ps.checkpoint import read_checkpoint, read_manifest
from adam_dask.testing import (
    fit_in_background,
    hard_kill,
    join_fit,
    synthetic_store,
    wait_for_pushes,
)
from adam_dask.train.metrics import History
from adam_dask.train.run_state import HISTORY, far_hosts, history_url, run_folder
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
BUCKET = "adam-outage"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("default-ckpt-data"), n_train=1024, n_test=256)


def small_trainer(store, client, slow=0.02, **kwargs):
    return Trainer(
        store,
        model=SPEC,
        client=client,
        lr=0.05,
        push_every=64,
        batch_size=8,
        progress=False,
        epoch_quorum=1.0,  # every replica's share is applied: images_applied is the split
        slow_replicas={0: slow, 1: slow},  # the faults land mid-epoch
        **kwargs,
    )


# -- where a run's checkpoint goes -------------------------------------------------------------------


def test_run_folder_resolution(runs_dir):
    a, b = run_folder(None, "0123456789"), run_folder(None, "abcdef0000")
    assert a.startswith(str(runs_dir) + "/") and b.startswith(str(runs_dir) + "/")
    assert a.endswith("-012345") and a != b  # a new folder per run
    assert run_folder(False, "x") is None
    assert run_folder("s3://bucket/run", "x") == "s3://bucket/run"
    with dask.config.set({"adam.train.runs-dir": None}):
        assert run_folder(None, "x") is None
    with dask.config.set({"adam.train.runs-dir": "rel/runs"}):
        assert run_folder(None, "x").startswith(os.path.abspath("rel/runs") + "/")
    with pytest.raises(ConfigError, match="checkpoint=True"):
        run_folder(True, "x")
    # a local folder is fit for PS workers on this machine only
    workers = ["tcp://127.0.0.2:4000", "tcp://192.0.2.7:4000"]
    assert far_hosts(a, workers) == ["192.0.2.7"]
    assert far_hosts("s3://bucket/run", workers) == []


# -- a default run through the loss of every copy of a shard ----------------------------------------


@pytest.mark.timeout(900)
def test_a_default_run_survives_the_loss_of_every_copy_of_a_shard(store, runs_dir):
    # 5 PS workers: three killed at once (their nannies bring them back under new addresses)
    # still leave live workers to rebuild on and copy to
    with adam_dask.cluster.local(
        ps_nodes=5, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        t = small_trainer(store, client, shard_bytes=4096)  # no checkpoint argument
        assert t.checkpoint is not None and t.checkpoint.startswith(str(runs_dir) + "/")
        th, box = fit_in_background(t, epochs=2)
        try:
            wait_for_pushes(t, box, 40)
            holders = t.server.placement()[1]
            hard_kill(client, holders)  # every copy of shard 1 at once
            join_fit(th, client, 600)
            assert "error" not in box, box.get("error")
            restored = {r["shard"] for r in t.server.stats()["restored"]}
            assert 1 in restored  # rebuilt from the run folder's checkpoint
            n = len(t.train_split)
            assert t.history.column("images_applied") == [n, n]  # nothing lost, nothing twice
            assert read_manifest(t.checkpoint)["epoch"] == 1
            assert History.load(os.path.join(t.checkpoint, HISTORY)).column("epoch") == [0, 1]
        finally:
            t.close()


# -- storage outages ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def moto_process():
    """moto's S3 server in a process of its own (so SIGSTOP freezes S3 and nothing else);
    yields {"pid", "options"} with a bucket made. S3 calls give up after a few seconds, so an
    outage shows as failing writes."""
    import s3fs

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    opts = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": f"http://127.0.0.1:{port}",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 2},
    }
    try:
        deadline = time.time() + 60
        while True:
            try:
                s3fs.S3FileSystem(**opts, skip_instance_cache=True).mkdir(BUCKET)
                break
            except Exception:
                assert proc.poll() is None and time.time() < deadline, "moto did not start"
                time.sleep(0.2)
        yield {"pid": proc.pid, "options": opts}
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


# write-backs retried quickly and flushes that give up after 5 s, so an outage of a few
# seconds outlasts them
SHORT = {
    "adam.ps.flush-timeout": 5,
    "adam.ps.writeback-interval": 0.2,
    "adam.ps.retry-base": 0.1,
    "adam.ps.retry-max": 0.5,
}


@pytest.fixture
def short_cluster():
    with (
        dask.config.set(SHORT),
        adam_dask.cluster.local(
            ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
        ) as client,
    ):
        yield client


@pytest.mark.timeout(600)
def test_a_flush_held_up_by_storage_names_storage_and_the_copies_do_not_wait(
    short_cluster, moto_process
):
    url = f"s3://{BUCKET}/ps"
    n = 3 * 4096
    opts = moto_process["options"]
    s = ParameterServer.create(
        short_cluster, size=n, shard_bytes=16384, checkpoint=url, storage_options=opts
    )
    try:
        s.push(np.ones(n, np.float32))
        s.flush(epoch=0, timeout=60)  # (a loaded machine's first writes may be slow)
        os.kill(moto_process["pid"], signal.SIGSTOP)  # S3 stops answering
        try:
            s.push(np.ones(n, np.float32))
            s.flush(copies_only=True, timeout=60)  # storage plays no part
            assert s.stats()["held_pushes"] > 0  # kept until the checkpoint has them
            with pytest.raises(StorageError) as err:
                s.flush(epoch=1)  # adam.ps.flush-timeout, 5 s
            line = str(err.value)
            assert line.startswith(f"storage {url}: ") and "\n" not in line, line
            assert "could not reach the primary" not in line
        finally:
            os.kill(moto_process["pid"], signal.SIGCONT)
        s.flush(epoch=1, timeout=60)  # caught up
        manifest, values = read_checkpoint(url, moto_process["options"])
        assert manifest["epoch"] == 1
        np.testing.assert_array_equal(values, np.full(n, 2, np.float32))
        assert s.stats()["held_pushes"] == 0
    finally:
        s.close()


EPOCHS = 6  # two end in the outage, the rest after it


@pytest.mark.timeout(900)
def test_training_goes_on_through_a_storage_outage_at_epochs_ends(
    store, short_cluster, moto_process, caplog
):
    caplog.set_level(logging.WARNING, logger="adam_dask.train.run_state")
    url = f"s3://{BUCKET}/run"
    opts = moto_process["options"]
    # epochs of several seconds: the outage spans two epochs' ends, and four follow it
    t = small_trainer(store, short_cluster, slow=0.1, checkpoint=url, storage_options=opts)
    th, box = fit_in_background(t, epochs=EPOCHS)
    stopped = False
    try:
        deadline = time.time() + 300
        while sum(t._progress_state.values()) < 256:  # a quarter into the first epoch
            assert "error" not in box and "history" not in box, box
            assert time.time() < deadline, "epoch 0 did not get going in 300 s"
            time.sleep(0.05)
        os.kill(moto_process["pid"], signal.SIGSTOP)
        stopped, t_stop = True, time.monotonic()
        # two epochs' ends pass while S3 is stopped, for longer than flush-timeout
        outage = 2 * SHORT["adam.ps.flush-timeout"]
        deadline = time.time() + 300
        while len(t.history.records) < 2 or time.monotonic() - t_stop < outage:
            assert "error" not in box, box["error"]
            assert time.time() < deadline, "training stalled in the outage"
            time.sleep(0.1)
        assert "history" not in box  # still training: the next epoch runs in the outage
        os.kill(moto_process["pid"], signal.SIGCONT)
        stopped = False
        # the end of fit waits flush-timeout for the last commit: room for a loaded machine
        with dask.config.set({"adam.ps.flush-timeout": 120}):
            join_fit(th, short_cluster, 600)
        assert "error" not in box, box.get("error")
        n = len(t.train_split)
        assert t.history.column("images_applied") == [n] * EPOCHS
        assert read_manifest(url, opts)["epoch"] == EPOCHS - 1  # caught up
        assert History.load(history_url(url), opts).column("epoch") == list(range(EPOCHS))
        warned = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"storage {url}: ") and "training goes on" in m for m in warned)
        assert any(m.startswith(f"storage {url} answers again") for m in warned), warned
    finally:
        if stopped:
            os.kill(moto_process["pid"], signal.SIGCONT)
        t.close()
