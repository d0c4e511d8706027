"""Elastic trainers: with replicas="auto" each epoch runs one replica per TRAIN worker present
when it starts, so a worker started during the run trains from the next epoch and a retired one
stops being counted."""

from __future__ import annotations

import signal
import time

import pytest

import adam_dask
from adam_dask.cluster import TRAIN
from adam_dask.testing import (
    fit_in_background,
    join_fit,
    role_worker,
    synthetic_store,
    wait_role_workers,
)
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("elastic-data"), n_train=768, n_test=256)


def test_a_train_worker_added_between_epochs_gets_a_replica(store):
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=1, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        t = Trainer(
            store, model=SPEC, client=client, lr=0.05, push_every=64, batch_size=8, progress=False
        )
        proc = None
        try:
            assert t.replicas is None  # "auto": decided at each epoch's start
            t.fit(epochs=1)
            assert t.history.last["replicas"] == 1
            proc = role_worker(client.scheduler.address, TRAIN, name="train-added", nthreads=1)
            added = set(wait_role_workers(client, TRAIN, 2)) - set(
                t.history.last["replica_workers"]
            )
            t.fit(epochs=2)
            rec = t.history.last
            assert rec["replicas"] == 2 and rec["replicas_finished"] == 2
            assert added <= set(rec["replica_workers"])  # the new worker trained a replica
            assert rec["images"] == 768  # the epoch's shares, split two ways, each once
            client.retire_workers(list(added))
            wait_role_workers(client, TRAIN, 1)
            t.fit(epochs=3)
            assert t.history.last["replicas"] == 1
            assert t.history.column("replicas") == [1, 2, 1]
        finally:
            t.close()
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)


def test_a_train_worker_evicted_mid_epoch_loses_no_image(store):
    """SIGTERM to a TRAIN worker's own process mid-epoch (a pod evicted: its worker closes
    gracefully and the process exits), sent from this process: its replica runs again on the
    TRAIN worker that is left, from the data position the parameter server holds, and the
    epoch applies every image once, none re-trained twice over."""
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=1, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        proc = role_worker(client.scheduler.address, TRAIN, name="train-added", nthreads=1)
        t = None
        try:
            wait_role_workers(client, TRAIN, 2)
            workers = client.scheduler_info(n_workers=-1)["workers"]
            victim = next(a for a, w in workers.items() if w.get("name") == "train-added")
            t = Trainer(
                store,
                model=SPEC,
                client=client,
                lr=0.05,
                push_every=64,
                batch_size=8,
                progress=False,
                epoch_quorum=1.0,  # every replica's share is applied: images_applied is the split
                slow_replicas={0: 0.05, 1: 0.05},
            )
            th, box = fit_in_background(t, epochs=1)
            deadline = time.monotonic() + 300
            while sum(t._progress_state.values()) < 128:
                assert time.monotonic() < deadline and "error" not in box, box.get("error")
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)  # from outside, as the kubelet does
            assert proc.wait(timeout=60) is not None  # its worker closed and it exited
            join_fit(th, client, 300)
            assert "error" not in box, box.get("error")
            rec = box["history"].records[0]
            assert rec["images_applied"] == 768  # nothing lost, nothing applied twice
            assert rec["replicas"] == 2
            assert victim not in rec["replica_workers"]  # its replica ran again on the other
        finally:
            if t is not None:
                t.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
