"""pipelines/train.py: a store URL to a checkpoint URL on any cluster, one JSON line, exit
statuses a job runner can act on, and a rerun that continues the run."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adam_dask.ps.checkpoint import read_manifest
from adam_dask.testing import synthetic_store

PIPELINE = str(Path(__file__).parents[2] / "pipelines" / "train.py")
SPEC = "conv5x5:6,maxpool2,fc32,fc10"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("pipeline-data"), n_train=768, n_test=256)


def job(*argv, timeout=280):
    proc = subprocess.run(
        [sys.executable, PIPELINE, *argv], capture_output=True, text=True, timeout=timeout
    )
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    return proc, result


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_train_pipeline_continues_a_run_when_run_again(store, adam_cluster, tmp_path):
    ckpt = str(tmp_path / "ck")
    where = ["--scheduler", adam_cluster.scheduler.address]
    proc, first = job(
        "--data", store, "--checkpoint", ckpt, "--model", SPEC, "--epochs", "1", *where
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first["resumed"] is False and first["epochs_trained"] == 1 and first["epoch"] == 0
    assert first["test_accuracy"] >= 0.5
    assert read_manifest(ckpt)["epoch"] == 0
    # the same job again, asked for two epochs in all: it trains the one that is missing
    proc, second = job("--data", store, "--checkpoint", ckpt, "--epochs", "2", *where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert second["resumed"] is True and second["epochs_trained"] == 1 and second["epoch"] == 1
    assert second["epochs_total"] == 2
    # and once more: nothing is left, the result is reported again
    proc, third = job("--data", store, "--checkpoint", ckpt, "--epochs", "2", *where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert third["epochs_trained"] == 0 and third["test_accuracy"] == second["test_accuracy"]


def test_train_pipeline_trains_a_pytorch_module_and_continues_it(store, adam_cluster, tmp_path):
    """--model package.module:factory: the torch engine, checked and started as adam-dask train
    does (one start-up); a rerun of the same job, --model included, continues the run."""
    pytest.importorskip("torch")
    ckpt = str(tmp_path / "ck")
    factory = "adam_dask.model.torch_examples:tiny_residual_net"
    argv = ["--data", store, "--checkpoint", ckpt, "--model", factory, "--lr", "0.05"]
    where = ["--scheduler", adam_cluster.scheduler.address]
    proc, first = job(*argv, "--epochs", "1", *where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first["epochs_trained"] == 1 and first["test_accuracy"] is not None
    model = read_manifest(ckpt)["meta"]["model"]
    assert model["engine"] == "torch" and model["factory"] == factory
    proc, second = job(*argv, "--epochs", "2", *where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert second["resumed"] is True and second["epochs_trained"] == 1 and second["epoch"] == 1
    # another network for the same run is refused, before any cluster is reached
    proc, _ = job(*argv[:-4], "--model", SPEC, "--epochs", "3", "--scheduler", "tcp://127.0.0.1:9")
    assert proc.returncode == 2
    assert "is not the network of the run" in one_error_line(proc)


def test_train_pipeline_bad_input_exits_2(store, tmp_path, capsys):
    proc, _ = job("--data", str(tmp_path / "none"), "--checkpoint", str(tmp_path / "ck"))
    assert proc.returncode == 2
    assert "no dataset store" in one_error_line(proc)
    # the same job in this process (its main), for the rest
    spec = importlib.util.spec_from_file_location("pipeline_train", PIPELINE)
    assert spec is not None and spec.loader is not None
    pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)
    for argv, words in (
        (["--epochs", "zero"], "--epochs"),
        (["--model", "fc"], "'fc'"),
        (["--storage-options", "{x"], "JSON"),
    ):
        try:
            status = pipeline.main(["--data", store, "--checkpoint", str(tmp_path / "ck"), *argv])
        except SystemExit as e:  # argparse's own errors
            status = e.code
        out, err = capsys.readouterr()
        assert status == 2 and out == "", err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err


def test_train_pipeline_sigterm_stops_cleanly(store, tmp_path):
    """Kubernetes stops a pod with SIGTERM: status 143, one error line, the checkpoint of the
    last finished epoch stays and the embedded cluster goes with the job."""
    ckpt = tmp_path / "ck"
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            PIPELINE,
            "--data",
            store,
            "--checkpoint",
            str(ckpt),
            "--model",
            SPEC,
            "--epochs",
            "50",
            "--metrics-out",
            str(metrics),
            "--ps-nodes",
            "1",
            "--data-nodes",
            "0",
            "--trainers",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and "Traceback" not in err, err[-2000:]
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]]
    assert lines[-1].startswith("error: terminated")
    assert read_manifest(str(ckpt))["epoch"] >= 0
