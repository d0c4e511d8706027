"""Batch job: train on a dataset store and leave a checkpoint, on any Dask cluster.

    python pipelines/train.py --data s3://bucket/mnist.zarr --checkpoint s3://bucket/runs/mnist \\
        [--gateway URL | --scheduler ADDRESS | --tls] [--epochs N] [--trainers 4] ...

Where it runs: a new cluster on the dask-gateway at ``--gateway`` (``--ps-nodes`` +
``--data-nodes`` + ``--trainers`` workers, shut down at the end), the scheduler at
``--scheduler``, or the embedded cluster on this machine (``--tls`` for TLS). Workers without
roles are given PS, DATA and TRAIN roles. The scheduler image needs adam_dask installed.

A job that is run again (after a crash, a pre-emption, a retry of the pod) continues the run
from its checkpoint: ``--epochs`` is the run's total, so a finished run trains nothing more and
reports its result again. ``--overwrite`` starts afresh over an existing checkpoint.

The last line on stdout is one JSON object: ``data``, ``checkpoint``, ``resumed``,
``epochs_total``, ``epochs_trained`` (by this invocation), ``epoch`` (the last finished, from
0), ``test_accuracy`` and ``loss`` of the last epoch, ``seconds``, ``images_per_second``,
``mode`` and ``dashboard``. Exit statuses are :mod:`adam_dask.jobs`': 0 done, 1 unforeseen
failure, 2 an error with its ``error:`` line, 130 interrupted, 143 terminated (SIGTERM).
Credentials (``--storage-options``, the AWS variables) never appear in the output.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from adam_dask import config
from adam_dask.jobs import (
    ArgumentParser,
    Redactor,
    count,
    fraction,
    json_object,
    positive_float,
    positive_int,
    run_job,
    setup_logging,
)

logger = logging.getLogger("pipelines.train")

__all__ = ["build_parser", "main", "train"]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pipelines/train.py", description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, metavar="URL", help="dataset store to train on")
    p.add_argument("--checkpoint", required=True, metavar="URL", help="the run's checkpoint")
    p.add_argument(
        "--epochs",
        type=positive_int,
        default=None,
        help="the run's total epochs (default: a resumed run's plan, else "
        f"{config.get('train.epochs')})",
    )
    p.add_argument("--target-accuracy", type=fraction, default=None, metavar="A")
    p.add_argument("--max-seconds", type=positive_float, default=None)
    p.add_argument("--mode", choices=("async", "sync"), default=None)
    p.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="a new run's network: a spec, or package.module:factory for a PyTorch module "
        "(importable on every TRAIN worker); a rerun may repeat it",
    )
    p.add_argument("--lr", type=positive_float, default=None)
    p.add_argument("--push-every", type=positive_int, default=None, metavar="K")
    p.add_argument("--replicas", type=positive_int, default=None)
    p.add_argument(
        "--partitions", type=positive_int, default=None, help="TRAIN workers each replica spans"
    )
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--augment", action="store_true", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--metrics-out", metavar="FILE", default=None)
    p.add_argument(
        "--overwrite", action="store_true", help="start afresh over an existing checkpoint"
    )
    p.add_argument("--storage-options", type=json_object, default=None, metavar="JSON")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDRESS")
    where.add_argument("--gateway", metavar="URL")
    where.add_argument("--tls", action="store_true", default=None)
    p.add_argument("--ps-nodes", type=count, default=None)
    p.add_argument("--data-nodes", type=count, default=None)
    p.add_argument("--trainers", type=count, default=None)
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _has_run(checkpoint: str, storage_options: dict | None) -> bool:
    """Whether a complete checkpoint (its manifest) is at ``checkpoint``."""
    from adam_dask.errors import CheckpointError
    from adam_dask.ps.checkpoint import read_manifest

    try:
        read_manifest(checkpoint, storage_options)
    except CheckpointError:
        return False
    return True


def train(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``args.data`` into ``args.checkpoint``; returns the JSON result. ``say`` shows
    a line of news (the dashboard's link, a resumed run) to whoever watches."""
    from adam_dask.cluster import dashboard_link
    from adam_dask.train import startup

    t0 = time.perf_counter()
    so = args.storage_options
    resume = not args.overwrite and _has_run(args.checkpoint, so)
    # the start-up adam-dask train makes: bad input fails before any cluster starts
    start = startup.Start(
        data=args.data,
        checkpoint=args.checkpoint,
        resume=resume,
        overwrite=args.overwrite,
        model=args.model,
        storage_options=so,
        seed=args.seed,
        replicas=args.replicas,
        partitions=args.partitions,
        scheduler=args.scheduler,
        gateway=args.gateway,
        tls=args.tls,
        ps_nodes=args.ps_nodes,
        data_nodes=args.data_nodes,
        trainers=args.trainers,
        threads=args.threads,
    )
    startup.check(start)
    client = startup.connect(start)
    link = dashboard_link(client)
    if link:
        say(f"dashboard: {link}")
    trainer = None
    try:
        if resume:
            say(f"continuing the run at {args.checkpoint}")
        trainer = startup.open_trainer(
            start,
            client,
            mode=args.mode,
            lr=args.lr,
            push_every=args.push_every,
            augment=args.augment,
            metrics_out=args.metrics_out,
            progress=False,
        )
        first = trainer.epoch
        # --epochs is the run's total (None: the resumed run's plan, or the configured default)
        trainer.fit(
            epochs=args.epochs, target_accuracy=args.target_accuracy, max_seconds=args.max_seconds
        )
        records = trainer.history.records
        new = [r for r in records if r["epoch"] >= first]
        last = records[-1] if records else {}
        images = sum(r["images"] for r in new)
        seconds = sum(r["seconds"] for r in new)
        return {
            "data": args.data,
            "checkpoint": args.checkpoint,
            "resumed": resume,
            "epochs_total": trainer.epochs,
            "epochs_trained": len(new),
            "epoch": last.get("epoch"),
            "test_accuracy": last.get("test_accuracy"),
            "loss": last.get("loss"),
            "seconds": round(time.perf_counter() - t0, 3),
            "images_per_second": round(images / seconds, 1) if seconds else 0.0,
            "mode": trainer.mode,
            "dashboard": link,
        }
    finally:
        if trainer is not None:
            trainer.close()
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; returns its exit status."""
    args = build_parser().parse_args(argv)
    redactor = Redactor([args.storage_options])
    setup_logging(args.verbose, redactor)

    def say(line: str) -> None:
        sys.stderr.write(redactor(line) + "\n")

    return run_job(lambda: train(args, say), redactor, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
