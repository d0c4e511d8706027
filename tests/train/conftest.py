"""Fixtures of the training tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def epoch_runs(monkeypatch):
    """Every epoch's :class:`~adam_dask.train._epoch_run.EpochRun` of the test, in order: a
    spy on ``run_replicas``, the one entry of every epoch's replicas, whole or partitioned."""
    from adam_dask.train import _epoch_run

    runs = []
    real = _epoch_run.run_replicas

    def spy(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(_epoch_run, "run_replicas", spy)
    return runs
