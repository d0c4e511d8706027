"""Benchmark: the batch pipelines on real MNIST, as a job runner starts them (a new process,
the embedded cluster), against S3 (moto's server on 127.0.0.1).

* ``reprocess``: the raw IDX files in S3 to a Zarr store in S3 with ``--augmented-epochs``
  pre-augmented epochs beside it, then the same job again (what a retry costs when everything
  is done);
* ``ingest_only``: the peer, the same job without augmented epochs (so the ratio is the price
  of one pre-augmented epoch against the dataset itself);
* ``train``: ``pipelines/train.py`` for ``--epochs`` on the new store, its checkpoint in S3.

Prints one JSON line (appended to ``benchmarks/results/pipelines.jsonl``).

    python benchmarks/pipelines.py [--augmented-epochs 1] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _job(script: str, *argv: str, env: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / script), *argv],
        capture_output=True,
        text=True,
        env=env,
    )
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return seconds, json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    import s3fs
    from _common import mnist_folder, record
    from moto.server import ThreadedMotoServer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--augmented-epochs", default="1")
    ap.add_argument("--epochs", default="1")
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = dict(
            os.environ,
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench-secret",
        )
        opts = json.dumps({"key": "bench", "secret": "bench-secret", "endpoint_url": endpoint})
        fs = s3fs.S3FileSystem(key="bench", secret="bench-secret", endpoint_url=endpoint)
        fs.mkdir("bench")
        src = mnist_folder()
        for name in os.listdir(src):
            if "ubyte" in name:
                fs.put_file(os.path.join(src, name), f"bench/raw/{name}")
        so = ["--storage-options", opts]

        peer_s, peer = _job("reprocess.py", "s3://bench/raw", "s3://bench/peer.zarr", *so, env=env)
        aug = ["--augmented-epochs", args.augmented_epochs]
        dest = "s3://bench/mnist.zarr"
        reprocess_s, result = _job("reprocess.py", "s3://bench/raw", dest, *aug, *so, env=env)
        again_s, again = _job("reprocess.py", "s3://bench/raw", dest, *aug, *so, env=env)
        assert again["augmented"]["blocks_written"] == 0 and not again["dataset"]["ingested"]
        train_s, trained = _job(
            "train.py",
            "--data",
            dest,
            "--checkpoint",
            "s3://bench/runs/mnist",
            "--epochs",
            args.epochs,
            *so,
            env=env,
        )
    finally:
        server.stop()
    images = peer["dataset"]["images"]
    train_images = 60000 * int(args.augmented_epochs)
    record(
        "pipelines",
        {
            "images": images,
            "augmented_epochs": int(args.augmented_epochs),
            "ingest_only_seconds": peer_s,
            "reprocess_seconds": reprocess_s,
            "reprocess_rerun_seconds": again_s,
            "augmented_images_per_second": train_images / max(reprocess_s - peer_s, 1e-9),
            "reprocess_over_ingest_only": reprocess_s / peer_s,
            "train_seconds": train_s,
            "train_epochs": trained["epochs_trained"],
            "train_images_per_second": trained["images_per_second"],
            "train_test_accuracy": trained["test_accuracy"],
            "storage": "s3 (moto on 127.0.0.1)",
            "cluster": "embedded (each job starts its own)",
        },
    )


if __name__ == "__main__":
    main()
