"""Benchmark: the epoch quorum (paper section 3.2.5): epoch time and accuracy when an epoch
ends at 100% vs 75% of the replicas, with one replica deliberately slowed.

Four replicas on the embedded cluster (4 TRAIN workers); replica 0 sleeps ``--delay`` seconds
per batch. Prints one JSON line and appends it to benchmarks/results/quorum.jsonl.

    python benchmarks/quorum.py [--epochs 3] [--delay 0.02]
"""

from __future__ import annotations

import argparse
import os
import sys


def run(quorum: float, store: str, args) -> dict:
    import adam_dask
    from adam_dask.train.trainer import Trainer

    with adam_dask.cluster.local(trainers=4, trainer_threads=1) as client:
        trainer = Trainer(
            store,
            client=client,
            epoch_quorum=quorum,
            progress=False,
            slow_replicas={0: args.delay},
            seed=args.seed,
        )
        try:
            trainer.fit(epochs=args.epochs)
        finally:
            trainer.close()
    h = trainer.history
    return {
        "epoch_seconds": [round(s, 2) for s in h.column("seconds")],
        "mean_epoch_seconds": round(sum(h.column("seconds")) / len(h), 2),
        "accuracy": h.last["test_accuracy"],
        "images_per_epoch": h.column("images"),
        "replicas_finished": h.column("replicas_finished"),
    }


def main() -> None:
    from _common import mnist_store, record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.02, help="seconds per batch, replica 0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    store = mnist_store()
    full, quorum = run(1.0, store, args), run(0.75, store, args)
    record(
        "quorum",
        (
            {
                "replicas": 4,
                "slow_replica_delay_per_batch": args.delay,
                "epochs": args.epochs,
                "epoch_seconds_quorum_1_0": full["mean_epoch_seconds"],
                "epoch_seconds_quorum_0_75": quorum["mean_epoch_seconds"],
                "speedup": round(full["mean_epoch_seconds"] / quorum["mean_epoch_seconds"], 3),
                "accuracy_quorum_1_0": full["accuracy"],
                "accuracy_quorum_0_75": quorum["accuracy"],
                "detail": {"1.0": full, "0.75": quorum},
            }
        ),
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
