"""``adam-dask train`` and ``adam-dask evaluate``."""

from __future__ import annotations

import logging
import time

from .. import config
from ..errors import ConfigError

logger = logging.getLogger(__name__)


def register(sub, add_storage, add_cluster) -> None:
    p = sub.add_parser("train", help="train a network on a dataset store (Project Adam)")
    p.add_argument("--data", required=True, metavar="URL", help="dataset store (adam-dask ingest)")
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"epochs to train (default {config.get('train.epochs')})",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        metavar="A",
        help="stop at the first epoch whose test accuracy reaches A (e.g. 0.99)",
    )
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument(
        "--replicas", type=int, default=None, help="model replicas (default: one per TRAIN worker)"
    )
    p.add_argument(
        "--mode",
        choices=("async", "sync"),
        default=None,
        help=f"asynchronous Adam or the synchronous baseline (default {config.get('train.mode')})",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help=f"network spec (default {config.get('model.spec')})",
    )
    p.add_argument(
        "--lr", type=float, default=None, help=f"learning rate (default {config.get('train.lr')})"
    )
    p.add_argument(
        "--push-every",
        type=int,
        default=None,
        metavar="K",
        help=f"images between pushes to the PS (default {config.get('train.push-every')})",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"Hogwild threads per replica (default {config.get('cluster.trainer-threads')})",
    )
    p.add_argument(
        "--epoch-quorum",
        type=float,
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
        "--checkpoint",
        metavar="URL",
        default=None,
        help="checkpoint URL (write-back target); with --resume, the one to continue",
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
        type=int,
        default=None,
        help="PS workers of the embedded or gateway cluster (or to assign roles to)",
    )
    p.add_argument("--data-nodes", type=int, default=None, help="DATA workers, likewise")
    p.add_argument("--trainers", type=int, default=None, help="TRAIN workers, likewise")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage(p)
    add_cluster(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="test accuracy of a checkpoint on a dataset store")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint URL")
    p.add_argument("--data", required=True, metavar="URL", help="dataset store")
    p.add_argument("--split", default="test", help="split to evaluate (default test)")
    add_storage(p)
    p.set_defaults(func=cmd_evaluate)


def _client(args):
    """The cluster to train on: --scheduler, --gateway (sized by the role counts), or the
    embedded one; workers without roles get them."""
    from ..cli import client_for
    from ..cluster import PS, assign_roles, local, workers_with_role

    ps = int(config.get("cluster.ps-nodes", args.ps_nodes))
    data = int(config.get("cluster.data-nodes", args.data_nodes))
    trainers = int(config.get("cluster.trainers", args.trainers))
    client = client_for(args, workers=ps + data + trainers)
    if client is None:
        return local(ps, data, trainers, trainer_threads=args.threads)
    if not workers_with_role(client, PS):
        assign_roles(client, ps_nodes=ps, data_nodes=data)
    return client


def cmd_train(args) -> dict:
    from .trainer import Trainer

    if args.resume and not args.checkpoint:
        raise ConfigError("--resume needs --checkpoint URL", "give the checkpoint to continue")
    for name in ("epochs", "replicas", "push_every", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {v} must be at least 1")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        raise ConfigError(
            f"--target-accuracy {args.target_accuracy} must lie in (0, 1]", "e.g. 0.99 for 99%"
        )
    # validate the store before starting a cluster
    from ..data.datasets import open_split

    open_split(args.data, "train", args.storage_options)
    t0 = time.perf_counter()
    client = _client(args)
    trainer = None
    try:
        kw = dict(
            replicas=args.replicas,
            mode=args.mode,
            push_every=args.push_every,
            lr=args.lr,
            threads=args.threads,
            epoch_quorum=args.epoch_quorum,
            augment=args.augment,
            metrics_out=args.metrics_out,
            progress=not args.no_progress,
            seed=args.seed,
            offload_dense=args.offload_dense,
        )
        if args.resume:
            trainer = Trainer.resume(
                args.checkpoint,
                data=args.data,
                client=client,
                storage_options=args.storage_options,
                **kw,
            )
        else:
            trainer = Trainer(
                args.data,
                model=args.model,
                client=client,
                checkpoint=args.checkpoint,
                storage_options=args.storage_options,
                overwrite=args.overwrite,
                **kw,
            )
        first = trainer.epoch
        history = trainer.fit(
            epochs=args.epochs, target_accuracy=args.target_accuracy, max_seconds=args.max_seconds
        )
        seconds = time.perf_counter() - t0
        new = [r for r in history.records if r["epoch"] >= first]
        images = sum(r["images"] for r in new)
        train_seconds = sum(r["seconds"] for r in new)
        result = {
            "test_accuracy": history.last["test_accuracy"] if history.last else None,
            "epochs": len(new),
            "epoch": history.last["epoch"] if history.last else None,
            "seconds": round(seconds, 3),
            "images_per_second": round(images / train_seconds, 1) if train_seconds else 0.0,
            "mode": trainer.mode,
            "replicas": trainer.replicas,
            "loss": history.last["loss"] if history.last else None,
        }
        if args.target_accuracy is not None:
            result["target_accuracy"] = args.target_accuracy
            result["seconds_to_target"] = (
                round(trainer.seconds_to_target, 3)
                if trainer.seconds_to_target is not None
                else None
            )
        if args.checkpoint:
            result["checkpoint"] = args.checkpoint
        return result
    finally:
        if trainer is not None:
            trainer.close()
        client.close()


def cmd_evaluate(args) -> dict:
    """Evaluate a checkpoint in this process: no cluster needed to read a manifest and weights."""
    from ..data.datasets import open_split
    from ..model.network import Network
    from ..ps.checkpoint import read_checkpoint

    t0 = time.perf_counter()
    manifest, values = read_checkpoint(args.checkpoint, args.storage_options)
    meta = manifest.get("meta") or {}
    if "model" not in meta:
        raise ConfigError(
            f"the checkpoint at {args.checkpoint} names no model",
            "it was not written by adam-dask train",
        )
    net = Network.from_dict(meta["model"])
    net.flat = values
    split = open_split(args.data, args.split, args.storage_options)
    if tuple(split.input_shape) != tuple(net.input_shape):
        raise ConfigError(
            f"the checkpoint's model takes {tuple(net.input_shape)} but "
            f"{args.data} holds {split.input_shape}",
            "evaluate on matching data",
        )
    x, y = split.read()
    acc = float(net.evaluate(x, y))
    return {
        "test_accuracy": acc,
        "images": len(y),
        "epoch": manifest.get("epoch"),
        "checkpoint": args.checkpoint,
        "split": args.split,
        "seconds": round(time.perf_counter() - t0, 3),
    }
