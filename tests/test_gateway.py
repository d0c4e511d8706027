"""Training on a dask-gateway cluster: a real dask-gateway-server (local backend) on 127.0.0.1,
its alike workers given PS, DATA and TRAIN roles after start-up, the PS placement plugin's
controller speaking TLS, data-serving actors included; run by pipelines/train.py --gateway."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from adam_dask.testing import synthetic_store

PASSWORD = "adam-test"
PIPELINE = str(Path(__file__).parents[1] / "pipelines" / "train.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    d = tmp_path_factory.mktemp("gateway")
    port = _free_port()
    (d / "config.py").write_text(
        textwrap.dedent(f"""
        import sys
        c.DaskGateway.address = "127.0.0.1:0"
        c.Proxy.address = "127.0.0.1:{port}"
        c.DaskGateway.backend_class = "dask_gateway_server.backends.local.UnsafeLocalBackend"
        c.DaskGateway.authenticator_class = "dask_gateway_server.auth.SimpleAuthenticator"
        c.SimpleAuthenticator.password = "{PASSWORD}"
        c.ClusterConfig.scheduler_cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
        c.ClusterConfig.worker_cmd = [sys.executable, "-m", "distributed.cli.dask_worker"]
        c.ClusterConfig.worker_cores = 1
        c.ClusterConfig.worker_threads = 1
        c.ClusterConfig.worker_memory = "1 G"
        c.ClusterConfig.scheduler_memory = "1 G"
        c.UnsafeLocalBackend.clusters_directory = "{d / "clusters"}"
    """)
    )
    log = open(d / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dask_gateway_server", "-f", str(d / "config.py")],
        cwd=d,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/api/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(
                    f"dask-gateway-server did not start: {(d / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
    env = dict(
        os.environ,
        DASK_GATEWAY__AUTH__TYPE="basic",
        DASK_GATEWAY__AUTH__KWARGS=json.dumps({"username": "alice", "password": PASSWORD}),
    )
    yield url, env
    proc.terminate()
    proc.wait(30)
    log.close()


def test_train_pipeline_on_a_gateway_cluster(gateway, tmp_path):
    url, env = gateway
    store = synthetic_store(tmp_path, n_train=512, n_test=128)
    proc = subprocess.run(
        [
            sys.executable,
            PIPELINE,
            "--gateway",
            url,
            "--data",
            store,
            "--epochs",
            "2",
            "--model",
            "conv5x5:6,maxpool2,fc32,fc10",
            "--ps-nodes",
            "3",
            "--data-nodes",
            "1",
            "--trainers",
            "1",
            "--checkpoint",
            str(tmp_path / "ck"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["epochs_trained"] == 2 and result["resumed"] is False
    assert result["test_accuracy"] >= 0.8
    assert PASSWORD not in proc.stdout + proc.stderr  # the gateway's credentials stay out
    assert (tmp_path / "ck" / "manifest.json").exists()
    # the job's cluster was shut down with it (asked through the gateway's REST API)
    auth = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(
        url + "/api/v1/clusters/", headers={"Authorization": f"Basic {auth}"}
    )

    def running() -> dict:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    deadline = time.time() + 30
    while running() and time.time() < deadline:
        time.sleep(0.5)
    assert running() == {}
