"""The embedded cluster is sized from the machine: trainers and threads from the cores, DATA
workers from the replicas' demand, memory split over the workers; a number in the configuration
or a keyword wins over "auto"."""

from __future__ import annotations

import dask.config
import pytest

from adam_dask import sizing
from adam_dask.cluster import local_spec
from adam_dask.errors import ConfigError


@pytest.mark.parametrize(
    "cores, expected",
    [
        (1, (1, 1)),
        (2, (1, 2)),
        (3, (1, 3)),
        (4, (2, 2)),
        (7, (2, 3)),
        (8, (2, 4)),
        (16, (2, 8)),
        (32, (4, 8)),
        (64, (8, 8)),
    ],
)
def test_trainers_and_threads_follow_the_cores(cores, expected):
    trainers, threads = sizing.size_trainers(cores)
    assert (trainers, threads) == expected
    assert trainers * threads <= cores  # no more training threads than cores
    # asynchronous replicas from 4 cores, and from 32 at least 4, so the 75% quorum can leave
    # a straggler behind
    if cores >= 4:
        assert trainers >= 2
    if cores >= 32:
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


@pytest.mark.parametrize("cores", [1, 2, 3])
def test_a_small_machine_gets_one_data_worker(cores):
    assert sizing.size_data_nodes(*sizing.size_trainers(cores)) == 1


def test_data_workers_grow_with_the_replicas_demand():
    per = sizing.DATA_THREADS_PER_NODE
    counts = [sizing.size_data_nodes(trainers, 2) for trainers in range(0, 65)]
    assert counts[0] == counts[1] == 1  # at least one, whatever the demand
    assert counts == sorted(counts)  # more replica threads never get fewer DATA workers
    for trainers, n in enumerate(counts):
        demand = trainers * 2
        assert n * per >= demand  # none serves more threads than it was measured to feed
        assert n == 1 or (n - 1) * per < demand  # and no more DATA workers than that needs
    # threads count as replicas do: the demand is their product
    assert (
        sizing.size_data_nodes(4, 8)
        == sizing.size_data_nodes(8, 4)
        == sizing.size_data_nodes(32, 1)
    )
    # the 16-core machine (8 replicas x 2 threads) gets more than the 2-core one
    assert sizing.size_data_nodes(*sizing.size_trainers(16)) > 1
    assert sizing.size_data_nodes(*sizing.size_trainers(64)) > sizing.size_data_nodes(8, 2)
    with pytest.raises(ValueError, match="at least one thread"):
        sizing.size_data_nodes(2, 0)


def _data_workers(workers: dict) -> int:
    return sum(name.startswith("data-") for name in workers)


def test_auto_data_nodes_are_sized_from_the_trainers_and_threads():
    assert dask.config.get("adam.cluster.data-nodes") == "auto"  # the default
    _, workers = local_spec(dashboard_address="")
    trainers, threads = sizing.size_trainers(sizing.machine_cores())
    assert _data_workers(workers) == sizing.size_data_nodes(trainers, threads)
    with dask.config.set({"adam.cluster.trainers": 8, "adam.cluster.trainer-threads": 2}):
        _, workers = local_spec(dashboard_address="")
    assert len(_train_workers(workers)) == 8
    assert _data_workers(workers) == sizing.size_data_nodes(8, 2) > 1
    _, workers = local_spec(trainers=1, trainer_threads=2, dashboard_address="")
    assert _data_workers(workers) == 1
    # a number wins, from the configuration or a keyword
    with dask.config.set({"adam.cluster.data-nodes": 3}):
        assert _data_workers(local_spec(trainers=8, dashboard_address="")[1]) == 3
    assert _data_workers(local_spec(data_nodes=0, trainers=8, dashboard_address="")[1]) == 0
    with dask.config.set({"adam.cluster.data-nodes": "lots"}):
        with pytest.raises(ConfigError, match="data_nodes='lots' is not a count"):
            local_spec(dashboard_address="")


def test_a_job_sizes_auto_data_nodes_from_its_trainers(monkeypatch):
    """client_for (the CLI's and the pipelines' way to a cluster) resolves "auto" as
    local_spec does, from the TRAIN workers and threads the job asks for."""
    from adam_dask import cluster

    asked = {}
    monkeypatch.setattr(cluster, "local", lambda ps, data, train, **kw: asked.update(data=data))
    cluster.client_for(trainers=8, trainer_threads=2)
    assert asked["data"] == sizing.size_data_nodes(8, 2) > 1
    cluster.client_for(trainers=1, trainer_threads=2)
    assert asked["data"] == 1
    cluster.client_for(data_nodes=2, trainers=1, trainer_threads=2)
    assert asked["data"] == 2
