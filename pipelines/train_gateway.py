"""Batch job: train on a fresh dask-gateway cluster, checkpoint to object storage.

The cluster gets --ps-nodes + --data-nodes + --trainers workers (default 3 + 1 + 2). The
gateway's workers are alike, so roles are given after start-up: the first --ps-nodes workers
(spread over hosts) hold the parameter server, the next --data-nodes serve data, the rest train. The scheduler image needs adam_dask installed; the placement plugin is registered
from here (or preload it: --preload adam_dask.ps.placement).

    python pipelines/train_gateway.py --gateway http://gateway:8000 --data s3://bucket/mnist.zarr \\
        --checkpoint s3://bucket/runs/mnist --epochs 10 --trainers 4

Prints the training summary as one JSON line, like `adam-dask train`.
"""

from __future__ import annotations

import sys

from adam_dask.cli import run

if __name__ == "__main__":
    sys.exit(run(["train", *sys.argv[1:]]))
