"""Shared fixtures: small synthetic datasets, a real S3 (moto's server on 127.0.0.1), real clusters."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from adam_dask.testing import write_mnist_like

logging.getLogger("werkzeug").setLevel(logging.ERROR)


# -- synthetic data: adam_dask.testing ------------------------------------------------------------


@pytest.fixture
def mnist_like(tmp_path) -> Path:
    return write_mnist_like(tmp_path / "src")


# -- S3: moto's real server on 127.0.0.1 ---------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (a free port); yields its storage options."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
    yield {"server": server, "options": opts, "endpoint": opts["endpoint_url"]}
    server.stop()


@pytest.fixture
def s3(s3_server, request):
    """A fresh bucket on the moto server; yields (bucket URL prefix, storage options)."""
    import s3fs

    opts = s3_server["options"]
    fs = s3fs.S3FileSystem(**opts)
    bucket = (
        "adam-"
        + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    )
    fs.mkdir(bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    yield f"s3://{bucket}", dict(opts)
    try:
        fs.rm(bucket, recursive=True)
    except Exception:
        pass


# -- noisy neighbours: adam_dask.testing.noise ---------------------------------------------------


_BUSY = pytest.StashKey["object"]()


@pytest.fixture
def busy_load(request):
    """Three busy processes per core beside the test's body, at the same priority (other
    tenants of a shared server). The fault and interrupt tests run under it: what they wait for
    must happen within the same bounds as on a quiet machine. The load starts as the body
    starts and ends with it (``pytest_runtest_call`` below): the clusters the test's fixtures
    start come up, and go, on a quiet machine, as a job's workers do before a neighbour gets
    busy; the faults, and whatever cluster the body starts itself, meet the load."""
    from adam_dask.testing.noise import BusyLoad

    load = BusyLoad(per_core=3)
    request.node.stash[_BUSY] = load
    return load


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    load = item.stash.get(_BUSY, None)
    if load is None:
        return (yield)
    with load:
        return (yield)


# -- clusters --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adam_cluster():
    """The embedded Adam cluster: 3 PS workers on distinct loopback hosts, 1 DATA, 2 TRAIN."""
    import adam_dask

    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        yield client


@pytest.fixture(scope="module")
def local_client():
    """A plain LocalCluster (2 workers, processes) for ingest and other role-free work; one per
    module, not per session: an idle scheduler in this process costs about 7% of a core, which
    the fault tests beside busy load would otherwise share with it (their cluster and this
    process are one scheduling group among the busy processes')."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            host="127.0.0.1",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def pytest_configure(config):
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(config.rootpath) / ".numba_cache"))
    # A run without a checkpoint argument writes one to its run folder (adam.train.runs-dir,
    # runs/ in the current directory): in the tests, under a temporary directory instead, for
    # this process and for the CLI, notebook and pipeline processes the tests start.
    import dask

    runs = tempfile.mkdtemp(prefix="adam-test-runs-")
    config._adam_runs = runs
    os.environ["DASK_ADAM__TRAIN__RUNS_DIR"] = runs
    dask.config.set({"adam.train.runs-dir": runs})
    # every PS node and controller checks its invariants after every event (adam.ps.validate),
    # here and in the worker, CLI and pipeline processes the tests start
    os.environ["DASK_ADAM__PS__VALIDATE"] = "True"
    dask.config.set({"adam.ps.validate": True})


def pytest_unconfigure(config):
    runs = getattr(config, "_adam_runs", None)
    if runs:
        shutil.rmtree(runs, ignore_errors=True)


@pytest.fixture
def runs_dir() -> Path:
    """The root of the run folders in this test session (adam.train.runs-dir)."""
    import dask

    return Path(dask.config.get("adam.train.runs-dir"))
