"""Mid-epoch resume after the whole cluster is lost: a cluster started from the command line
(``dask scheduler``, ``dask worker --resources ...``), its scheduler and then its workers
SIGKILLed mid-epoch, a new cluster, ``adam-dask train --resume``: the epoch goes on from the
data positions in the checkpoint, each image applied once, and the history stays one record."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from adam_dask.ps.checkpoint import read_manifest, read_marks
from adam_dask.testing import synthetic_store
from adam_dask.train._position import applied_images

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
N_TRAIN = 2048


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("resume-data"), n_train=N_TRAIN, n_test=256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_cluster() -> tuple[str, subprocess.Popen, list[subprocess.Popen]]:
    """A scheduler and 3 PS (distinct loopback hosts), 1 DATA and 1 TRAIN worker processes."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-dashboard",
        ],
        **quiet,
    )
    roles = [("PS=1", "127.0.0.2"), ("PS=1", "127.0.0.3"), ("PS=1", "127.0.0.4")]
    roles += [("DATA=1", "127.0.0.1"), ("TRAIN=1", "127.0.0.1")]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                address,
                "--nthreads",
                "1",
                "--resources",
                res,
                "--no-nanny",
                "--host",
                host,
                "--memory-limit",
                "1GiB",
            ],
            **quiet,
        )
        for res, host in roles
    ]
    from distributed import Client

    with Client(address, timeout=60) as c:
        c.wait_for_workers(len(workers), timeout=120)
    return address, scheduler, workers


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


FIRST_RUN = textwrap.dedent(
    """
    import sys
    from distributed import Client
    from adam_dask.train.trainer import Trainer

    address, store, ckpt = sys.argv[1:4]
    with Client(address) as client:
        t = Trainer(store, model="{spec}", client=client, checkpoint=ckpt, lr=0.05,
                    push_every=64, batch_size=8, epoch_quorum=1.0, progress=False,
                    slow_replicas={{0: 0.25}})
        t.fit(epochs=2)
    """
).format(spec=SPEC)


def _epoch_applied(ckpt: str, epoch: int) -> tuple[int | None, int]:
    """(the manifest's last finished epoch, images of ``epoch`` its blocks hold)."""
    try:
        manifest = read_manifest(ckpt)
        marks = read_marks(ckpt, None, manifest)
    except Exception:  # not written yet, or being replaced
        return None, 0
    per_shard = {}
    for sid, ms in marks.items():
        per: dict = {}
        for m in ms:
            if m.epoch == epoch:
                per.setdefault(m.replica, []).append(m)
        per_shard[sid] = per
    return manifest.get("epoch"), applied_images(per_shard)


def test_resume_mid_epoch_after_losing_the_whole_cluster(store, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    address, scheduler, workers = _start_cluster()
    run = subprocess.Popen(
        [sys.executable, "-c", FIRST_RUN, address, store, ckpt],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while True:  # mid-epoch 1: the checkpoint holds part of it
            finished, applied = _epoch_applied(ckpt, 1)
            if finished == 0 and N_TRAIN // 4 <= applied:
                break
            assert run.poll() is None, "the first run ended before it was interrupted"
            assert time.monotonic() < deadline, (finished, applied)
            time.sleep(0.2)
        assert applied < N_TRAIN
        _kill([scheduler])  # the scheduler first (the controller, the manifest's writer)
        time.sleep(1.0)
        _kill(workers + [run])
    finally:
        _kill([scheduler, *workers, run])
    finished, held = _epoch_applied(ckpt, 1)
    assert finished == 0 and 0 < held < N_TRAIN

    address, scheduler, workers = _start_cluster()
    metrics = tmp_path / "metrics.jsonl"
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "adam_dask.cli",
                "train",
                "--resume",
                "--checkpoint",
                ckpt,
                "--data",
                store,
                "--scheduler",
                address,
                "--epochs",
                "2",
                "--metrics-out",
                str(metrics),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        _kill([scheduler, *workers])
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["epochs"] == 1 and result["epoch"] == 1  # the interrupted epoch, finished
    history = [json.loads(line) for line in open(os.path.join(ckpt, "history.jsonl"))]
    assert [r["epoch"] for r in history] == [0, 1]  # one continuous record
    last = history[-1]
    assert last["images_applied"] == N_TRAIN  # each image of the split applied once
    # the resumed run trained what the checkpoint did not hold (plus at most the pushes some
    # shards missed), not the epoch again
    assert last["images"] <= N_TRAIN - held + 2 * 64
    assert last["test_accuracy"] >= 0.8
    assert [json.loads(line)["epoch"] for line in open(metrics)] == [1]
