"""The clusters the commands run on (adam_dask.cluster): the embedded cluster with TLS and its
dashboard, and client_for's choice between a scheduler, a gateway and the embedded cluster."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import adam_dask
from adam_dask.cluster import client_for, dashboard_link, local_spec
from adam_dask.data.datasets import open_split
from adam_dask.errors import ConfigError
from adam_dask.testing import synthetic_digits, synthetic_store, write_mnist_like

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


def test_tls_cluster_ingests_and_trains(tmp_path):
    """--tls: every address is tls://, and ingest and training work over it."""
    from adam_dask.data.ingest import ingest
    from adam_dask.train import Trainer

    src = write_mnist_like(tmp_path / "src", n_train=512, n_test=128)
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=1, trainer_threads=1, memory_limit="2 GiB", tls=True
    ) as client:
        assert client.scheduler.address.startswith("tls://")
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert len(workers) == 5 and all(a.startswith("tls://") for a in workers)
        ingest(str(src), str(tmp_path / "d.zarr"), client=client)
        train = open_split(str(tmp_path / "d.zarr"), "train")
        assert (train.images[:] == synthetic_digits(512, seed=0)[0]).all()
        t = Trainer(
            str(tmp_path / "d.zarr"),
            model=SPEC,
            client=client,
            push_every=64,
            progress=False,
            checkpoint=str(tmp_path / "ck"),
        )
        try:
            t.fit(epochs=2)
        finally:
            t.close()
        assert t.history.last["test_accuracy"] >= 0.5, t.history.records
        assert (tmp_path / "ck" / "manifest.json").exists()


def test_cli_train_tls_prints_the_dashboard_and_no_key(tmp_path):
    store = synthetic_store(tmp_path, n_train=256, n_test=64)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "adam_dask.cli",
            "-vv",
            "train",
            "--tls",
            "--data",
            store,
            "--model",
            SPEC,
            "--epochs",
            "1",
            "--ps-nodes",
            "1",
            "--data-nodes",
            "0",
            "--trainers",
            "1",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["epochs"] == 1
    assert "tls://127.0.0.1:" in proc.stderr  # Dask's own logs (-vv) show the TLS addresses
    links = [line for line in proc.stderr.splitlines() if line.startswith("dashboard: http")]
    assert len(links) == 1 and "127.0.0.1:" in links[0]
    assert "PRIVATE KEY" not in proc.stderr + proc.stdout
    assert "BEGIN CERTIFICATE" not in proc.stderr + proc.stdout


def test_dashboard_is_served_and_moves_off_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with adam_dask.cluster.local(
            ps_nodes=1, data_nodes=0, trainers=1, dashboard_address=f"127.0.0.1:{port}"
        ) as client:
            link = dashboard_link(client)
            assert link is not None and link.startswith("http://127.0.0.1:")
            assert f":{port}/" not in link
            with urllib.request.urlopen(link, timeout=30) as page:
                assert page.status == 200


def test_a_dashboard_port_taken_while_the_cluster_starts_moves_too(monkeypatch):
    """The port was free when asked and is taken before the scheduler binds it (an earlier
    cluster still closing on a loaded machine): the cluster starts on a free port instead of
    failing with 'Port ... is already in use'."""
    import adam_dask.cluster as cluster_mod

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    taken = socket.socket()
    checked = cluster_mod._free_dashboard_address

    def check_then_lose_the_port(address: str) -> str:
        out = checked(address)
        taken.bind(("127.0.0.1", port))  # another process takes it right after the check
        taken.listen()
        return out

    monkeypatch.setattr(cluster_mod, "_free_dashboard_address", check_then_lose_the_port)
    try:
        with adam_dask.cluster.local(
            ps_nodes=1, data_nodes=0, trainers=1, dashboard_address=f"127.0.0.1:{port}"
        ) as client:
            link = dashboard_link(client)
            assert link is not None and f":{port}/" not in link
    finally:
        taken.close()


def test_dashboard_can_be_turned_off():
    scheduler, workers = local_spec(1, 0, 1, dashboard_address="")
    assert scheduler["options"]["dashboard"] is False
    assert not any(w["options"]["dashboard"] for w in workers.values())
    scheduler, _ = local_spec(1, 0, 1)  # the default: the scheduler serves it
    assert scheduler["options"]["dashboard"] is True


def test_client_for_refuses_contradictions():
    with pytest.raises(ConfigError, match="not both"):
        client_for("tcp://127.0.0.1:1", "http://127.0.0.1:2")
    with pytest.raises(ConfigError, match="embedded cluster only"):
        client_for("tcp://127.0.0.1:1", tls=True)
    assert client_for(embedded=False) is None


def test_client_for_a_scheduler_assigns_roles_once(local_client):
    """A plain cluster's workers get roles on the first connection, and keep them."""
    from distributed import LocalCluster

    from adam_dask.cluster import DATA, PS, TRAIN, workers_with_role

    with LocalCluster(
        n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0"
    ) as cluster:
        with client_for(cluster.scheduler_address, ps_nodes=1, data_nodes=1) as client:
            first = {r: workers_with_role(client, r) for r in (PS, DATA, TRAIN)}
            assert [len(v) for v in first.values()] == [1, 1, 1]
        with client_for(cluster.scheduler_address, ps_nodes=2, data_nodes=0) as client:
            assert {r: workers_with_role(client, r) for r in (PS, DATA, TRAIN)} == first


# A closed client sits in a reference cycle until the garbage collector finalises it, and its
# __del__ closes it again. A collection runs inside whatever allocation comes next: here, while
# this thread holds the lock every client and cluster takes to start or stop its event loop (a new
# cluster's start holds it), as happened once inside the suite. The script runs in a process of
# its own, so a hang fails this test instead of stopping the suite.
_COLLECTED_UNDER_THE_LOOP_LOCK = """
import gc, weakref
from distributed import LocalCluster
from distributed.utils import LoopRunner
from adam_dask.cluster import EmbeddedClient

cluster = LocalCluster(n_workers=1, processes=False, dashboard_address=":0")
with EmbeddedClient(cluster) as client:
    assert client.submit(sum, [1, 2]).result() == 3
print("cluster", cluster.status.name, flush=True)
client.itself = client  # a cycle, whatever distributed's own references are
alive = weakref.ref(client)
del client
with LoopRunner._lock:
    gc.collect()
print("collected", alive() is None, flush=True)
"""


def _run_script(script: str, timeout: float, hung: str) -> subprocess.CompletedProcess:
    """``script`` in a Python process of its own; a hang fails the test with ``hung``."""
    try:
        return subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{hung}; it printed {exc.stdout!r}")


def test_a_closed_client_collected_under_the_loop_lock_does_not_hang():
    proc = _run_script(
        _COLLECTED_UNDER_THE_LOOP_LOCK, 90, "the collector hung finalising a closed client"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["cluster", "closed", "collected", "True"], proc.stderr[-2000:]


# The same finalising on the cluster's own event loop (a collection runs wherever the next
# allocation is: the scheduler's loop, mid-write, as happened once in the suite). A close that
# waited there for the loop would wait for itself: the scheduler stopped for good.
_COLLECTED_ON_ITS_LOOP = """
import gc, threading, time
from distributed import Client, LocalCluster
from adam_dask.cluster import EmbeddedClient

cluster = LocalCluster(n_workers=1, processes=False, dashboard_address=":0")
client = EmbeddedClient(cluster)
assert client.submit(sum, [1, 2]).result() == 3
Client.close(client)  # the client closed, its cluster still running (a close cut short)
client.itself = client
del client
collected = threading.Event()

def collect():
    gc.collect()
    collected.set()

cluster.loop.add_callback(collect)
print("loop", "free" if collected.wait(30) else "stuck", flush=True)
deadline = time.monotonic() + 30
while cluster.status.name != "closed" and time.monotonic() < deadline:
    time.sleep(0.1)
print("cluster", cluster.status.name, flush=True)
"""


def test_a_client_collected_on_its_clusters_loop_closes_the_cluster_without_stopping_it():
    proc = _run_script(
        _COLLECTED_ON_ITS_LOOP, 120, "finalising the client stopped its cluster's loop"
    )
    assert proc.stdout.split() == ["loop", "free", "cluster", "closed"], proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_worker_lost_before_its_restart_registers_keeps_its_nanny():
    """A nanny restarts the worker it lost; the embedded cluster never closes that nanny, even
    when no worker of its name is registered ``lost-worker-timeout`` after the loss (a worker
    SIGKILLed twice within it, as a fault test does; shortened here so the check lands before
    the restart registers)."""
    import dask

    from adam_dask.cluster import PS, workers_with_role
    from adam_dask.testing import hard_kill

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "0.1s"}):
        with adam_dask.cluster.local(
            ps_nodes=1, data_nodes=0, trainers=0, memory_limit="1 GiB"
        ) as client:
            (victim,) = workers_with_role(client, PS)
            hard_kill(client, [victim])
            deadline = time.monotonic() + 120
            while not (back := workers_with_role(client, PS)):
                assert time.monotonic() < deadline, "the lost PS worker's nanny did not restart it"
                time.sleep(0.2)
            assert back != [victim]
            assert len(client.cluster.workers) == 1  # the cluster still holds its nanny
