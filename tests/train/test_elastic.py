"""Elastic trainers: with replicas="auto" each epoch runs one replica per TRAIN worker present
when it starts, so a worker started during the run trains from the next epoch and a retired one
stops being counted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import adam_dask
from adam_dask.cluster import TRAIN, workers_with_role
from adam_dask.testing import synthetic_store
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("elastic-data"), n_train=768, n_test=256)


def _start_train_worker(scheduler: str) -> subprocess.Popen:
    """A plain ``dask worker --resources TRAIN=1`` process, as an operator would add one."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            scheduler,
            "--nthreads",
            "1",
            "--resources",
            "TRAIN=1",
            "--no-nanny",
            "--host",
            "127.0.0.1",
            "--memory-limit",
            "2GiB",
            "--name",
            "train-added",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_trainers(client, n: int, timeout: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = workers_with_role(client, TRAIN)
        if len(found) == n:
            return found
        time.sleep(0.2)
    raise AssertionError(f"expected {n} TRAIN workers, found {workers_with_role(client, TRAIN)}")


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
            proc = _start_train_worker(client.scheduler.address)
            added = set(_wait_trainers(client, 2)) - set(t.history.last["replica_workers"])
            t.fit(epochs=2)
            rec = t.history.last
            assert rec["replicas"] == 2 and rec["replicas_finished"] == 2
            assert added <= set(rec["replica_workers"])  # the new worker trained a replica
            assert rec["images"] == 768  # the epoch's shares, split two ways, each once
            client.retire_workers(list(added))
            _wait_trainers(client, 1)
            t.fit(epochs=3)
            assert t.history.last["replicas"] == 1
            assert t.history.column("replicas") == [1, 2, 1]
        finally:
            t.close()
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
