"""``adam-dask train`` and ``adam-dask evaluate``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from .. import config
from ..cluster import dashboard_link
from ..errors import ConfigError
from ..jobs import (
    count,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    server_optimizer,
)
from ..storage import redact_url
from ._common import add_cluster, add_storage

logger = logging.getLogger(__name__)

__all__ = ["cmd_evaluate", "cmd_train", "register", "train_result"]


def register(sub) -> None:
    """Add the ``train`` and ``evaluate`` sub-commands to ``sub`` (argparse sub-parsers)."""
    p = sub.add_parser("train", help="train a network on a dataset store (Project Adam)")
    p.add_argument("--data", required=True, metavar="URL", help="dataset store (adam-dask ingest)")
    p.add_argument(
        "--epochs",
        type=positive_int,
        default=None,
        help="the run's total epochs, as Keras counts them: with --resume, only the ones not "
        f"trained yet run (default {config.get('train.epochs')}, or the resumed run's plan)",
    )
    p.add_argument(
        "--target-accuracy",
        type=fraction,
        default=None,
        metavar="A",
        help="stop at the first epoch whose test accuracy reaches A (e.g. 0.99)",
    )
    p.add_argument(
        "--max-seconds", type=positive_float, default=None, help="stop after this many seconds"
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=None,
        help="model replicas (default: one per TRAIN worker)",
    )
    p.add_argument(
        "--partitions",
        type=positive_int,
        default=None,
        help="TRAIN workers each model replica spans, for models too large for one "
        f"(default {config.get('train.partitions')})",
    )
    p.add_argument(
        "--mode",
        choices=("async", "sync"),
        default=None,
        help="asynchronous Adam or the synchronous baseline (default "
        f"{config.get('train.mode')}; a resumed run keeps its own)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help=f"network spec (default {config.get('model.spec')}), or package.module:factory, "
        "a zero-argument callable returning a PyTorch nn.Module (the torch engine; the package "
        "must be importable on every TRAIN worker)",
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help=f"learning rate (default {config.get('train.lr')})",
    )
    p.add_argument(
        "--lr-warmup",
        type=non_negative_float,
        default=None,
        metavar="EPOCHS",
        help="ramp the rate up over the first EPOCHS epochs (default "
        f"{config.get('train.lr-warmup')}); many asynchronous replicas need it",
    )
    p.add_argument(
        "--lr-replicas",
        type=positive_int,
        default=None,
        metavar="N",
        help="async: --lr is the rate for N replicas; with R > N each steps lr * N / R, "
        "instead of --lr-streams and the auto push period's damping "
        f"(default {config.get('train.lr-replicas')})",
    )
    p.add_argument(
        "--lr-streams",
        type=positive_int,
        default=None,
        metavar="N",
        help="async: each of a replica's T threads past N steps lr * N / T "
        f"(default {config.get('train.lr-streams')})",
    )
    p.add_argument(
        "--push-every",
        type=positive_int,
        default=None,
        metavar="K",
        help=f"images between pushes to the PS (default {config.get('train.push-every')})",
    )
    p.add_argument(
        "--server-optimizer",
        type=server_optimizer,
        default=None,
        metavar="NAME",
        help="what the parameter server does with each push: sum (Adam's), nesterov, "
        f"sum+staleness or nesterov+staleness (default {config.get('ps.optimizer')})",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help=f"Hogwild threads per replica (default {config.get('cluster.trainer-threads')})",
    )
    p.add_argument(
        "--epoch-quorum",
        type=fraction,
        default=None,
        help=f"fraction of replicas that ends an epoch (default {config.get('train.epoch-quorum')})",
    )
    p.add_argument(
        "--augment",
        action="store_true",
        default=None,
        help="augment on the data servers (affine + elastic distortions)",
    )
    p.add_argument(
        "--offload-dense",
        action="store_true",
        default=None,
        help="send dense layers' activations and error terms; the PS computes their "
        "updates (where that saves bytes)",
    )
    p.add_argument(
        "--average-from",
        type=_fraction_below_one,
        default=None,
        metavar="F",
        help="also validate the mean of the end-of-epoch weights from this fraction of the "
        "planned epochs on (e.g. 0.5; default adam.train.average-from, off)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="URL",
        default=None,
        help="checkpoint URL (write-back target); with --resume, the one to continue "
        f"(default: a new run folder in {config.get('train.runs-dir')}/, adam.train.runs-dir)",
    )
    p.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="write no checkpoint (a run that loses every copy of a shard then ends, and "
        "cannot be resumed)",
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing checkpoint at --checkpoint (otherwise refused)",
    )
    p.add_argument("--metrics-out", metavar="FILE", default=None, help="per-epoch JSONL history")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--ps-nodes",
        type=count,
        default=None,
        help="PS workers of the embedded or gateway cluster (or to assign roles to)",
    )
    p.add_argument("--data-nodes", type=count, default=None, help="DATA workers, likewise")
    p.add_argument("--trainers", type=count, default=None, help="TRAIN workers, likewise")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage(p)
    add_cluster(p, tls=True)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="test accuracy of a checkpoint on a dataset store")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint URL")
    p.add_argument("--data", required=True, metavar="URL", help="dataset store")
    p.add_argument(
        "--split",
        default=None,
        help=f"split to evaluate (default {config.get('cli.evaluate-split')})",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PKG.MOD:FACTORY",
        help="the PyTorch module to load the weights into (for a run that trained a module "
        "object rather than a factory)",
    )
    add_storage(p)
    p.set_defaults(func=cmd_evaluate)


def _start(args: argparse.Namespace) -> Any:
    """What ``train`` was asked, for the start-up it shares with the pipelines."""
    from ..train.startup import Start

    return Start(
        data=args.data,
        checkpoint=args.checkpoint,
        resume=args.resume,
        overwrite=args.overwrite,
        no_checkpoint=args.no_checkpoint,
        model=args.model,
        storage_options=args.storage_options,
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


def _fraction_below_one(text: str) -> float:
    """A number in [0, 1): a point of the run, as a fraction of its planned epochs."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} must lie in [0, 1), e.g. 0.5 for the 2nd half")
    return value


def train_result(trainer: Any, first_epoch: int, seconds: float, target: float | None) -> dict:
    """The JSON result of a training run: this invocation's epochs and the last validation."""
    records = trainer.history.records
    new = [r for r in records if r["epoch"] >= first_epoch]
    last = records[-1] if records else None
    images = sum(r["images"] for r in new)
    train_seconds = sum(r["seconds"] for r in new)
    result: dict[str, Any] = {
        "test_accuracy": last["test_accuracy"] if last else None,
        "epochs": len(new),
        "epoch": last["epoch"] if last else None,
        "seconds": round(seconds, 3),
        "images_per_second": round(images / train_seconds, 1) if train_seconds else 0.0,
        "mode": trainer.mode,
        "replicas": getattr(trainer, "replicas", None),
        "loss": last["loss"] if last else None,
    }
    if last and "average_accuracy" in last:
        result["average_accuracy"] = last["average_accuracy"]
        result["averaged_epochs"] = last["averaged_epochs"]
    if target is not None:
        result["target_accuracy"] = target
        reached = trainer.seconds_to_target if new else None
        result["seconds_to_target"] = round(reached, 3) if reached is not None else None
    result["checkpoint"] = trainer.checkpoint  # None with --no-checkpoint
    return result


def cmd_train(args: argparse.Namespace) -> dict:
    from ..train import startup

    start = _start(args)
    startup.check(start)  # bad input fails in a second, before a cluster starts
    t0 = time.perf_counter()
    client = startup.connect(start)
    link = dashboard_link(client)
    if link:
        sys.stderr.write(f"dashboard: {link}\n")
    trainer = None
    try:
        trainer = startup.open_trainer(
            start,
            client,
            mode=args.mode,  # None on --resume: the run keeps its own mode
            push_every=args.push_every,
            server_optimizer=args.server_optimizer,
            lr=args.lr,
            lr_warmup=args.lr_warmup,
            lr_replicas=args.lr_replicas,
            lr_streams=args.lr_streams,
            epoch_quorum=args.epoch_quorum,
            augment=args.augment,
            metrics_out=args.metrics_out,
            offload_dense=args.offload_dense,
            average_from=args.average_from,
            progress=not args.no_progress,
        )
        if trainer.checkpoint:
            sys.stderr.write(f"checkpoint: {redact_url(trainer.checkpoint)}\n")
        if trainer.partitions > 1:  # checked before anything starts
            sys.stderr.write(trainer.check_partitions().describe() + "\n")
        first = trainer.epoch
        # --epochs is the run's total (Keras's epochs with initial_epoch); None: the plan
        trainer.fit(
            epochs=args.epochs, target_accuracy=args.target_accuracy, max_seconds=args.max_seconds
        )
        if trainer.epoch == first:
            logger.warning(
                "the run at %s had %d epochs already: nothing was left to train",
                redact_url(args.checkpoint),
                first,
            )
        return train_result(trainer, first, time.perf_counter() - t0, args.target_accuracy)
    finally:
        if trainer is not None:
            trainer.close()
        client.close()


def cmd_evaluate(args: argparse.Namespace) -> dict:
    """Evaluate a checkpoint in this process: no cluster needed to read a manifest and weights."""
    from ..data.datasets import open_split
    from ..model.engines import read_network
    from ..train.validation import calibration_images

    t0 = time.perf_counter()
    split_name = config.get("cli.evaluate-split", args.split)
    manifest, net = read_network(
        args.checkpoint, model=args.model, storage_options=args.storage_options
    )
    split = open_split(args.data, split_name, args.storage_options)
    if tuple(split.input_shape) != tuple(net.input_shape):
        raise ConfigError(
            f"the checkpoint's model takes {tuple(net.input_shape)} but "
            f"{args.data} holds {split.input_shape}",
            "evaluate on matching data",
        )
    if net.batch_norm:  # its population statistics are not stored: recompute them
        net.calibrate(calibration_images(open_split(args.data, "train", args.storage_options)))
    x, y = split.read()
    return {
        "test_accuracy": float(net.evaluate(x, y)),
        "images": len(y),
        "epoch": manifest.get("epoch"),
        "checkpoint": args.checkpoint,
        "split": split_name,
        "seconds": round(time.perf_counter() - t0, 3),
    }
