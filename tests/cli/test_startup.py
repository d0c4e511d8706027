"""The start-up ``adam-dask train`` and ``pipelines/train.py`` share (adam_dask.train.startup):
the embedded cluster sized for what was asked."""

from __future__ import annotations

import json

import dask
import pytest

from adam_dask.cli import run
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


def test_partitions_alone_train_on_the_embedded_cluster(store, capsys):
    """``adam-dask train --partitions 2`` on a machine sized for one replica (2 cores: one
    TRAIN worker) starts two TRAIN workers, one per partition, instead of refusing."""
    with dask.config.set({"adam.cluster.trainers": 1, "adam.cluster.memory-limit": "1 GiB"}):
        status = run(
            ["train", "--data", store, "--partitions", "2", "--model", SPEC, "--epochs", "1"]
            + ["--push-every", "64", "--no-checkpoint", "--no-progress"]
        )
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["replicas"] == 1 and result["epochs"] == 1, result
    assert result["test_accuracy"] >= 0.3, result  # chance is 0.1
    assert "partition 1" in err, err[-3000:]  # the plan of the two partitions, printed
