"""Credentials go nowhere: ``adam-dask train`` on S3 (moto's server on 127.0.0.1) with a
sentinel secret in its storage options and in the AWS variables, and the sentinel is found in
no log line of any process of the run (the CLI, the embedded cluster's scheduler, nannies and
workers all write to the CLI's stderr), not on stdout, in no object of the bucket (data,
checkpoint blocks and manifest, history), no file the run wrote locally (metrics, scratch
space) and no page or JSON of the dashboard."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import s3fs

from adam_dask.testing import synthetic_store

pytestmark = pytest.mark.slow

SPEC = "conv5x5:6,maxpool2,fc32,fc10"  # small and quick
SENTINEL = "SENTINEL-7f3a9c2e"  # every secret of the run holds it; moto checks none of them


def sentinel_env(tmp: Path) -> dict[str, str]:
    """The environment of the run: AWS variables holding the sentinel, the logs of every
    process at their most talkative (botocore's debug lines show each request's headers, the
    session token and the access key among them), temporary files under ``tmp``."""
    scratch = tmp / "scratch"
    scratch.mkdir()
    return dict(
        os.environ,
        AWS_ACCESS_KEY_ID=f"{SENTINEL}-env-id",
        AWS_SECRET_ACCESS_KEY=f"{SENTINEL}-env-secret",
        AWS_SESSION_TOKEN=f"{SENTINEL}-env-token",
        # the workers' and the scheduler's own logs too, and this package's at debug level
        DASK_DISTRIBUTED__LOGGING__DISTRIBUTED="debug",
        DASK_DISTRIBUTED__LOGGING__ADAM_DASK="debug",
        DASK_DISTRIBUTED__LOGGING__BOTOCORE="debug",  # logs every request's headers, signature and token
        TMPDIR=str(scratch),
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    )


def watch_dashboard(proc: subprocess.Popen, pages: list[str]) -> tuple[threading.Thread, list]:
    """Read the run's stderr in a thread; once it names the dashboard, fetch the Adam page and
    its JSON every half second until the run ends. Returns (thread, stderr lines)."""
    lines: list[str] = []

    def run() -> None:
        base = None
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.match(r"dashboard: (http://\S+?)(/status)?$", line.strip())
            if m and base is None:
                base = m.group(1) + "/adam"
                threading.Thread(target=poll, args=(base,), daemon=True).start()

    def poll(base: str) -> None:
        while proc.poll() is None:
            for url in (base, base + "/status.json"):
                try:
                    with urllib.request.urlopen(url, timeout=10) as r:
                        pages.append(r.read().decode())
                except OSError:
                    pass
            time.sleep(0.5)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, lines


def every_object(fs: s3fs.S3FileSystem, bucket: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {p: fs.cat_file(p) for p in fs.find(bucket)}


def every_file(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def test_train_on_s3_leaks_no_credential(s3, tmp_path):
    url, plain = s3  # a fresh bucket; moto's own test credentials, to set up and read back
    bucket = url[len("s3://") :]
    fs = s3fs.S3FileSystem(**plain, skip_instance_cache=True)
    store = synthetic_store(tmp_path / "src", n_train=512, n_test=128)
    fs.put(store, f"{bucket}/d.zarr", recursive=True)
    secret_options = {
        "key": f"{SENTINEL}-key",
        "secret": f"{SENTINEL}-secret",
        "token": f"{SENTINEL}-token",
        "endpoint_url": plain["endpoint_url"],
        "client_kwargs": {"region_name": "us-east-1"},
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adam_dask.cli",
            "-vv",
            "train",
            "--data",
            f"s3://{bucket}/d.zarr",
            "--checkpoint",
            f"s3://{bucket}/ckpt",
            "--storage-options",
            json.dumps(secret_options),
            "--metrics-out",
            str(metrics),
            "--model",
            SPEC,
            "--epochs",
            "2",
            "--ps-nodes",
            "3",
            "--data-nodes",
            "1",
            "--trainers",
            "1",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=run_dir,
        env=sentinel_env(tmp_path),
    )
    pages: list[str] = []
    reader, lines = watch_dashboard(proc, pages)
    try:
        out = proc.stdout.read() if proc.stdout else ""
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)
    err = "".join(lines)
    assert proc.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["epochs"] == 2 and result["checkpoint"] == f"s3://{bucket}/ckpt"
    assert metrics.read_text().count("\n") == 2
    # the run really logged from its workers and its scheduler, and served the dashboard
    assert "distributed.worker" in err and "distributed.scheduler" in err, err[-4000:]
    assert pages, "the dashboard was never reached"

    objects = every_object(fs, bucket)
    assert any(p.endswith("ckpt/manifest.json") for p in objects), sorted(objects)
    files = every_file(tmp_path)
    assert str(metrics) in files
    places = {"stdout": out.encode(), "stderr": err.encode()}
    places.update({f"dashboard {i}": p.encode() for i, p in enumerate(pages)})
    places.update({f"s3://{p}": data for p, data in objects.items()})
    places.update(files)
    leaks = {
        where: data[max(0, i - 200) : i + 60]
        for where, data in places.items()
        if (i := data.find(SENTINEL.encode())) >= 0
    }
    assert not leaks, leaks  # where, and what was around the secret there
