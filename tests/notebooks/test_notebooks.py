"""The notebooks run top to bottom in a real Jupyter kernel, on small synthetic data (the
notebooks read its location and size from ``ADAM_NOTEBOOK_*`` environment variables)."""

from __future__ import annotations

import hashlib
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from adam_dask.testing import synthetic_store, write_mnist_like

pytestmark = pytest.mark.slow

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


def _png(content: dict) -> str | None:
    return content.get("data", {}).get("image/png")


def test_quickstart_notebook_plots_every_epoch_of_the_run(run_notebook, tmp_path, monkeypatch):
    epochs = 3
    monkeypatch.setenv("ADAM_NOTEBOOK_SOURCE", str(write_mnist_like(tmp_path / "src", 1024, 256)))
    monkeypatch.setenv("ADAM_NOTEBOOK_DATA", str(tmp_path / "digits.zarr"))
    monkeypatch.setenv("ADAM_NOTEBOOK_SPEC", SPEC)
    monkeypatch.setenv("ADAM_NOTEBOOK_EPOCHS", str(epochs))
    monkeypatch.setenv("ADAM_NOTEBOOK_TORCH_EPOCHS", "2")
    run = run_notebook("01_quickstart.ipynb")
    text = run.text()
    assert "ingested 1280 images" in text
    assert re.search(r"Adam page: +http://\S+/adam", text)
    train = run.cell_index("trainer = adam_dask.Trainer(")
    msgs = [(t, c) for i, t, c in run.messages if i == train]
    # the plot: shown once, then redrawn once per epoch, each time a different picture
    (plot_id,) = {c["transient"]["display_id"] for t, c in msgs if t == "display_data" and _png(c)}
    updates = [
        n
        for n, (t, c) in enumerate(msgs)
        if t == "update_display_data" and c["transient"]["display_id"] == plot_id
    ]
    assert len(updates) == epochs
    pictures = {hashlib.sha256(_png(msgs[n][1]).encode()).hexdigest() for n in updates}
    assert len(pictures) == epochs
    # one progress bar (a widget) per epoch; each epoch was drawn before the next one began
    bars = [
        n
        for n, (t, c) in enumerate(msgs)
        if t == "display_data" and "application/vnd.jupyter.widget-view+json" in c["data"]
    ]
    assert len(bars) == epochs
    assert all(bars[k] < updates[k] < bars[k + 1] for k in range(epochs - 1))
    assert len(re.findall(r"^epoch \d: loss", text, re.M)) == epochs
    # evaluation and the misclassified digits
    evaluate = run.cell_index("test_images, test_labels")
    assert re.search(r"test accuracy 0\.\d+: \d+ of 256 misclassified", run.text(evaluate))
    assert any("image/png" in o.get("data", {}) for o in run.outputs(evaluate))
    saved = re.search(r"accuracy (\d\.\d+); resumed: (\d\.\d+)", text)
    assert saved is not None and saved.group(1) == saved.group(2)
    assert float(saved.group(1)) >= 0.8
    # a user-defined PyTorch module (padding, stride, a residual block) trained by the same
    # system, its weights exported to a plain module that predicts the same
    own = re.findall(r"^own model, epoch \d: test accuracy (\d+\.\d+)%", text, re.M)
    assert len(own) == 2 and float(own[-1]) >= 80, text
    assert "the plain module agrees on 100% of 256 digits" in text


def test_system_at_work_notebook_shows_a_fail_over(run_notebook, tmp_path, monkeypatch):
    epochs = 4
    monkeypatch.setenv("ADAM_NOTEBOOK_DATA", synthetic_store(tmp_path, 1024, 256))
    monkeypatch.setenv("ADAM_NOTEBOOK_SPEC", SPEC)
    monkeypatch.setenv("ADAM_NOTEBOOK_EPOCHS", str(epochs))
    run = run_notebook("02_system_at_work.ipynb")
    text = run.text()
    killed = re.search(r"killing (tcp://127\.0\.0\.\d+:\d+), primary of (\d+) shard", text)
    assert killed is not None and int(killed.group(2)) >= 1
    victim = killed.group(1)
    assert re.search(r"healed in \d+\.\d s", text)
    moved = re.findall(r"shard \d+: primary (\S+) -> (\S+)", text)
    assert len(moved) == int(killed.group(2))
    assert all(old == victim and new != victim for old, new in moved)
    assert "the killed worker holds no shard: True" in text
    assert len(re.findall(r"^epoch \d: test accuracy", text, re.M)) == epochs
    assert f"manifest: epoch {epochs - 1}" in text
    assert f"history: {epochs} epochs" in text
    # the Adam page's tables: before training, placed, and after the fail-over
    tables = [h for h in run.html() if 'id="adam"' in h]
    assert len(tables) == 3
    assert 'class="shard-table"' in tables[1] and victim in tables[1]
    assert "worker-lost" in tables[2] and victim in tables[2].split('id="events"')[1]
    assert victim not in tables[2].split('class="shard-table"')[1].split("</table>")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dask_cluster_processes(tmp_path):
    """A scheduler started as ``dask scheduler`` with the adam preloads, and workers started
    with ``dask worker --resources``: 3 PS (distinct loopback hosts), 1 DATA, 1 TRAIN."""
    from distributed import Client

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    log = open(tmp_path / "cluster.log", "w")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dashboard-address",
                f"127.0.0.1:{_free_port()}",
                "--preload",
                "adam_dask.ps.placement",
                "--preload",
                "adam_dask.dashboard",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    ]
    workers = [("127.0.0.2", "PS"), ("127.0.0.3", "PS"), ("127.0.0.4", "PS")]
    workers += [("127.0.0.1", "DATA"), ("127.0.0.1", "TRAIN")]
    for host, role in workers:
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    address,
                    "--host",
                    host,
                    "--nthreads",
                    "1",
                    "--memory-limit",
                    "2GiB",
                    "--resources",
                    f"{role}=1",
                    "--no-dashboard",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(len(workers), timeout=120)
        yield address
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


def test_connect_notebook_on_a_dask_scheduler(
    run_notebook, dask_cluster_processes, tmp_path, monkeypatch
):
    epochs = 2
    monkeypatch.setenv("ADAM_NOTEBOOK_SCHEDULER", dask_cluster_processes)
    monkeypatch.setenv("ADAM_NOTEBOOK_DATA", synthetic_store(tmp_path, 512, 128))
    monkeypatch.setenv("ADAM_NOTEBOOK_CHECKPOINT", str(tmp_path / "ck"))
    monkeypatch.setenv("ADAM_NOTEBOOK_SPEC", SPEC)
    monkeypatch.setenv("ADAM_NOTEBOOK_EPOCHS", str(epochs))
    run = run_notebook("03_connect.ipynb")
    text = run.text()
    roles = dict(re.findall(r"^(PS|DATA|TRAIN) +(\[.*\])$", text, re.M))
    assert roles["PS"].count("tcp://") == 3 and roles["DATA"].count("tcp://") == 1
    assert roles["TRAIN"].count("tcp://") == 1
    accuracies = re.findall(r"^epoch \d: loss \S+, test accuracy (\d+\.\d+)%", text, re.M)
    assert len(accuracies) == epochs and float(accuracies[-1]) >= 80
    assert (tmp_path / "ck" / "manifest.json").exists()
    # the page the scheduler's preload serves
    page = re.search(r"Adam page: (http://\S+/adam)", text)
    assert page is not None
    deadline = time.monotonic() + 30
    with urllib.request.urlopen(page.group(1) + "/status.json", timeout=30) as r:
        assert r.status == 200 and time.monotonic() < deadline
    assert any('class="shard-table"' in h for h in run.html())
