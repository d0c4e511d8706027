"""Dask's task profiler is off on the workers where ``adam.cluster.task-profiler`` says so (on
CPython 3.11 by default: its stack sampling can deadlock a worker process), on the embedded
cluster's workers (their preload) and on any other cluster's (the parameter server's worker
plugin)."""

from __future__ import annotations

import dask
import pytest

import adam_dask
from adam_dask._worker_preload import PROFILER_CALLBACKS, TaskProfiler, task_profiler_allowed
from adam_dask.errors import ConfigError


def profiling(client) -> dict[str, bool]:
    """{worker: whether Dask's task profiler runs there}."""

    def running(dask_worker) -> bool:
        pcs = [dask_worker.periodic_callbacks.get(n) for n in PROFILER_CALLBACKS]
        return all(pc is not None and pc.is_running() for pc in pcs)

    return client.run(running)


@pytest.mark.parametrize("setting", [True, False])
def test_the_embedded_workers_follow_the_setting(setting):
    with (
        dask.config.set({"adam.cluster.task-profiler": setting}),
        adam_dask.cluster.local(ps_nodes=1, data_nodes=1, trainers=1) as client,
    ):
        seen = profiling(client)
    assert len(seen) == 3 and set(seen.values()) == {setting}, seen


def test_the_plugin_stops_the_profiler_on_another_clusters_workers(local_client):
    assert set(profiling(local_client).values()) == {True}  # Dask's default: on
    local_client.register_plugin(TaskProfiler(False))
    seen = profiling(local_client)
    assert len(seen) == 2 and set(seen.values()) == {False}, seen


def test_auto_turns_it_off_on_cpython_3_11_only():
    assert not task_profiler_allowed("auto", (3, 11, 7))
    assert task_profiler_allowed("AUTO", (3, 12, 1))
    assert task_profiler_allowed("auto", (3, 13, 0))
    assert task_profiler_allowed(True, (3, 11, 7))
    assert not task_profiler_allowed(False, (3, 12, 1))
    assert not task_profiler_allowed("false", (3, 12, 1))  # DASK_ADAM__CLUSTER__TASK_PROFILER
    assert task_profiler_allowed("True", (3, 11, 7))


def test_a_bad_setting_is_one_clear_error_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"task-profiler is 'sometimes'.*auto, true or false"):
        TaskProfiler("sometimes")
    with (
        dask.config.set({"adam.cluster.task-profiler": "sometimes"}),
        pytest.raises(ConfigError, match="task-profiler"),
    ):
        adam_dask.cluster.local_spec(ps_nodes=1, data_nodes=0, trainers=0)
