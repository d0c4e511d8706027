"""Batch job: reprocess a dataset that lives in S3, then train on it and evaluate.

1. ingest raw IDX files or class folders from ``--src`` (s3://...) into a Zarr store at
   ``--dest`` (s3://...), the writes done by Dask tasks on the cluster;
2. train on the new store (``--epochs``), checkpointing to ``--checkpoint``;
3. evaluate the checkpoint on the store's test split.

Credentials and endpoints come from the AWS variables (``AWS_ENDPOINT_URL`` too) or
``--storage-options JSON``. Without ``--scheduler``/``--gateway`` it runs on the embedded cluster.

    python pipelines/reprocess_s3.py --src s3://raw/mnist --dest s3://curated/mnist.zarr \\
        --checkpoint s3://curated/runs/mnist --epochs 5 --overwrite

Prints one JSON line: the ingest, train and evaluate results.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from contextlib import redirect_stdout

from adam_dask.cli import run


def step(argv: list[str]) -> dict:
    buf = io.StringIO()
    with redirect_stdout(buf):
        status = run(argv)
    if status != 0:  # the error line is already on stderr
        sys.exit(status)
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--dest", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--epochs", default="5")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--storage-options", default=None)
    ap.add_argument("--scheduler", default=None)
    ap.add_argument("--gateway", default=None)
    args, train_extra = ap.parse_known_args()
    so = ["--storage-options", args.storage_options] if args.storage_options else []
    where = (
        ["--scheduler", args.scheduler]
        if args.scheduler
        else ["--gateway", args.gateway]
        if args.gateway
        else []
    )
    ingested = step(
        [
            "ingest",
            args.src,
            args.dest,
            *so,
            *(["--overwrite"] if args.overwrite else []),
            *(["--scheduler", args.scheduler] if args.scheduler else []),
        ]
    )
    trained = step(
        [
            "train",
            "--data",
            args.dest,
            "--epochs",
            args.epochs,
            "--checkpoint",
            args.checkpoint,
            "--no-progress",
            *so,
            *where,
            *train_extra,
        ]
    )
    evaluated = step(["evaluate", args.checkpoint, "--data", args.dest, *so])
    print(
        json.dumps(
            {
                "ingest": {k: ingested[k] for k in ("images", "shape", "classes", "seconds")},
                "train": trained,
                "evaluate": evaluated,
            }
        )
    )


if __name__ == "__main__":
    main()
