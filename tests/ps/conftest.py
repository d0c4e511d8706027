"""Fixtures of the parameter-server tests: a small embedded cluster (3 PS workers on distinct
loopback hosts, one TRAIN worker), and servers that are closed after each test."""

from __future__ import annotations

import logging

import pytest

logger = logging.getLogger(__name__)


def small_cluster(ps_nodes: int = 3, trainers: int = 1):
    import adam_dask

    return adam_dask.cluster.local(
        ps_nodes=ps_nodes, data_nodes=0, trainers=trainers, trainer_threads=1, memory_limit="1 GiB"
    )


@pytest.fixture(scope="module")
def ps_client():
    """A module-scoped cluster: 3 PS workers (127.0.0.2-4), 1 TRAIN worker."""
    with small_cluster() as client:
        yield client


@pytest.fixture
def make_server(ps_client):
    """``make_server(**kwargs)`` creates a ParameterServer on ``ps_client``; all are closed after
    the test."""
    from adam_dask.ps import ParameterServer

    made = []

    def make(client=None, **kwargs):
        s = ParameterServer.create(client or ps_client, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        try:
            s.close()
        except Exception:
            logger.exception("closing %r failed", s)
