"""The embedded cluster is sized from the machine: trainers and threads from the cores, memory
split over the workers; a number in the configuration or a keyword wins over "auto"."""

from __future__ import annotations

import dask.config
import pytest

from adam_dask import sizing
from adam_dask.cluster import local_spec
from adam_dask.errors import ConfigError


@pytest.mark.parametrize(
    "cores, expected",
    [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (7, (3, 2)), (8, (4, 2)), (64, (32, 2))],
)
def test_trainers_and_threads_follow_the_cores(cores, expected):
    trainers, threads = sizing.size_trainers(cores)
    assert (trainers, threads) == expected
    assert trainers * threads <= cores  # no more training threads than cores
    # from 8 cores there are at least 4 replicas, so the 75% quorum can leave a straggler behind
    if cores >= 8:
        assert trainers >= 4 and int(0.75 * trainers) < trainers


def test_memory_is_split_over_the_workers():
    assert sizing.size_memory_limit(24 << 30, 6) == 4 << 30
    with pytest.raises(ValueError, match="at least one worker"):
        sizing.size_memory_limit(1 << 30, 0)
    with pytest.raises(ValueError, match="at least one core"):
        sizing.size_trainers(0)


def _train_workers(workers: dict) -> list[dict]:
    return [w["options"] for name, w in workers.items() if name.startswith("train-")]


def test_auto_settings_size_the_embedded_cluster_from_this_machine():
    _, workers = local_spec(dashboard_address="")
    trainers, threads = sizing.size_trainers(sizing.machine_cores())
    train = _train_workers(workers)
    assert len(train) == trainers and {w["nthreads"] for w in train} == {threads}
    limit = sizing.machine_memory() // len(workers)
    assert {w["options"]["memory_limit"] for w in workers.values()} == {limit}
    assert sizing.resolve_threads("auto") == threads


def test_numbers_win_over_auto():
    with dask.config.set({"adam.cluster.trainers": 3, "adam.cluster.memory-limit": "1 GiB"}):
        _, workers = local_spec(dashboard_address="", trainer_threads=2)
    train = _train_workers(workers)
    assert len(train) == 3 and {w["nthreads"] for w in train} == {2}
    assert {w["options"]["memory_limit"] for w in workers.values()} == {"1 GiB"}


def test_a_setting_that_is_neither_a_count_nor_auto_is_refused():
    with dask.config.set({"adam.cluster.trainers": "many"}):
        with pytest.raises(ConfigError, match="trainers='many' is not a count"):
            local_spec(dashboard_address="")
