"""A real dask-gateway-server (local backend) configured with ``deploy/gateway/values.yaml``'s
own ``extraConfig``: the same options handler and scheduler preloads as on Kubernetes."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PASSWORD = "adam-deploy-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values_extra_config() -> str:
    """The chart's way: every ``gateway.extraConfig`` block, in the order of its keys."""
    values = yaml.safe_load((DEPLOY / "gateway" / "values.yaml").read_text())
    extra = values["gateway"]["extraConfig"]
    return "\n".join(extra[k] for k in sorted(extra))


@pytest.fixture(scope="session")
def values_python() -> str:
    """The Python of ``values.yaml``'s ``gateway.extraConfig``, as the chart appends it."""
    return values_extra_config()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """(URL, password) of a dask-gateway-server on 127.0.0.1 running the values' extraConfig;
    the clusters' commands use this interpreter instead of the image's ``dask``."""
    import dask_gateway_server  # noqa: F401  (the [test] extra; missing, the test fails)

    d = tmp_path_factory.mktemp("gateway")
    port = _free_port()
    local = textwrap.dedent(f"""
        # -- this machine instead of Kubernetes ----------------------------------------------
        import sys
        c.DaskGateway.address = "127.0.0.1:0"
        c.Proxy.address = "127.0.0.1:{port}"
        c.DaskGateway.backend_class = "dask_gateway_server.backends.local.UnsafeLocalBackend"
        c.DaskGateway.authenticator_class = "dask_gateway_server.auth.SimpleAuthenticator"
        c.SimpleAuthenticator.password = "{PASSWORD}"
        c.UnsafeLocalBackend.clusters_directory = "{d / "clusters"}"
        c.ClusterConfig.scheduler_memory = "1 G"
        # the values' commands, run by this interpreter ("dask scheduler ..." -> python -m ...)
        _sched = c.ClusterConfig.scheduler_cmd
        assert list(_sched[:2]) == ["dask", "scheduler"], _sched
        c.ClusterConfig.scheduler_cmd = [
            sys.executable, "-m", "distributed.cli.dask_scheduler", *_sched[2:]
        ]
        assert list(c.ClusterConfig.worker_cmd) == ["dask", "worker"]
        c.ClusterConfig.worker_cmd = [sys.executable, "-m", "distributed.cli.dask_worker"]
    """)
    (d / "config.py").write_text(values_extra_config() + "\n" + local)
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
            urllib.request.urlopen(url + "/api/health", timeout=2).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                proc.wait()
                log.close()
                pytest.fail(
                    f"dask-gateway-server did not start: {(d / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.2)
    try:
        yield url, PASSWORD
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
