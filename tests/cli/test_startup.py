"""The start-up ``adam-dask train`` and ``pipelines/train.py`` share (adam_dask.train.startup):
the embedded cluster sized for what was asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dask
import pytest

from adam_dask.testing import synthetic_store
from adam_dask.train.startup import train_workers

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("startup-data"), n_train=512, n_test=128)


def test_train_workers_are_one_per_partition_of_each_replica():
    with dask.config.set({"adam.cluster.trainers": 3}):
        assert train_workers(None, None, None) is None  # one partition: the configured count
        assert train_workers(None, None, 2) == 6  # the configured replicas, 2 workers each
        assert train_workers(None, 2, 3) == 6
        assert train_workers(4, None, 2) == 4  # a count given is the user's
    with dask.config.set({"adam.cluster.trainers": 1, "adam.train.partitions": 2}):
        assert train_workers(None, None, None) == 2


def test_partitions_alone_train_on_the_embedded_cluster(store, tmp_path):
    """``adam-dask train --partitions 2`` on a machine sized for one replica (2 cores: one
    TRAIN worker) starts two TRAIN workers, one per partition, instead of refusing. In a
    process of its own, as a user runs it (the embedded cluster ends with it)."""
    env = dict(os.environ)
    env["DASK_ADAM__CLUSTER__TRAINERS"] = "1"  # what `auto` gives on 2 cores
    env["DASK_ADAM__CLUSTER__MEMORY_LIMIT"] = "1 GiB"
    env["DASK_ADAM__TRAIN__RUNS_DIR"] = str(tmp_path / "runs")
    proc = subprocess.run(
        [sys.executable, "-m", "adam_dask.cli", "train", "--data", store, "--partitions", "2"]
        + ["--model", SPEC, "--epochs", "1", "--push-every", "64", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replicas"] == 1 and result["epochs"] == 1, result
    assert result["test_accuracy"] >= 0.3, result  # chance is 0.1
    assert "partition 1" in proc.stderr, proc.stderr[-3000:]  # the plan, printed
