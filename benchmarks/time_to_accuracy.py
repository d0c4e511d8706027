"""Benchmark: wall seconds for `adam-dask train` on real MNIST to reach a test accuracy, beside
the same engine alone in one process and the same network in PyTorch on CPU.

Prints one JSON line and appends it to benchmarks/results/time_to_accuracy.jsonl. Three runs, in
this order, each stopping at the first epoch at or above ``--target``:

* ours (``ours_*``): the real CLI on the embedded cluster with its defaults, so the wall figure
  includes starting the cluster; ``ours_seconds_to_target`` counts from the start of training.
* the engine alone (``engine_*``): the same engine (``HogwildReplica``), network spec and seed,
  recipe (lr, the schedule over the planned epochs, momentum, batch size) and the same total
  threads as the cluster's trainers x threads per trainer, sharing one set of weights in this
  process: no cluster, no parameter server, no data servers. The same augmentation when the
  embedded cluster augments by default (``adam.augment.enabled``; off today), drawn here per
  epoch before its training. Evaluated on the test set after each epoch, as ours is;
  ``engine_seconds_to_target`` counts from the start of training (input conversion, epochs,
  evaluations).
* PyTorch (``torch_*``): SGD, batch 32, ``--threads`` threads, and the learning-rate schedule that
  reached the target fastest for it.

``ours_over_torch`` and ``ours_over_engine`` are the ratios of seconds to the target,
``images_per_second_vs_engine`` the ratio of training images/s (issue 28's goals, in ``goals``:
``ours_over_torch`` <= 0.6, ``images_per_second_vs_engine`` >= 0.8). ``--epochs`` is the runs' plan (the learning-rate
schedule anneals over it; default ``adam.train.epochs``). Wall seconds on a shared machine are
noisy: the epochs to the target and ``load`` (1-minute load averages before and after) say how to
read them.

    python benchmarks/time_to_accuracy.py [--target 0.99] [--epochs 10] [--no-save]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def cluster_trainers() -> tuple[int, int]:
    """(trainers, threads per trainer) of the embedded cluster (``adam.cluster``, sized from
    the machine when "auto")."""
    from adam_dask import config, sizing

    auto_n, auto_t = sizing.size_trainers(sizing.machine_cores())
    n, t = config.get("cluster.trainers"), config.get("cluster.trainer-threads")
    n = auto_n if str(n).lower() == sizing.AUTO else int(n)
    t = auto_t if str(t).lower() == sizing.AUTO else int(t)
    return n, t


def engine_fit_to_target(
    xtr,
    ytr,
    xte,
    yte,
    *,
    target: float,
    epochs: int,
    threads: int,
    train_eval: int = 0,
    clean_last: int = 0,
    weight_decay: float = 0.0,
) -> dict:
    """Train the configured network with one ``HogwildReplica`` of ``threads`` threads on the
    Trainer's recipe (``adam.train.*``, ``adam.model.*``), evaluating after each epoch, until
    test accuracy >= ``target`` or ``epochs``. ``train_eval``: also score the first that many
    training images, unaugmented, after each epoch (``train_curve``: over- or under-fitting).
    With ``adam.train.average-from`` set, the tail average of the end-of-epoch weights is
    scored too (``average_curve``), as the Trainer does.

    Explorations only: ``clean_last`` trains the last that many epochs on undistorted images;
    ``weight_decay`` shrinks the weights (not the biases) by ``1 - lr * weight_decay`` after
    every mini-batch (decoupled L2; the engine has no such option)."""
    import numpy as np

    from adam_dask import config
    from adam_dask.data.augment import Augment, to_float
    from adam_dask.model import Network
    from adam_dask.train._average import TailAverage
    from adam_dask.train.replica import HogwildReplica
    from adam_dask.train.schedule import Schedule

    seed = int(config.get("train.seed"))
    net = Network.from_spec(config.get("model.spec"), input_shape=(1, *xtr.shape[1:]), seed=seed)
    plan = Schedule.from_config(epochs=epochs)
    rep = HogwildReplica(
        net,
        threads=threads,
        momentum=config.get("train.momentum"),
        batch_size=config.get("train.batch-size"),
        schedule=plan,
    )
    aug = Augment.default()
    if aug is not None and aug.is_identity:
        aug = None
    average_from = config.get("train.average-from")
    average = None if average_from is None else TailAverage.planned(float(average_from), epochs)
    decay: dict = {}
    if weight_decay > 0:
        spans = [
            (e.offset, e.offset + e.size) for e in net.layout.entries if e.name.endswith("weight")
        ]

        def shrink(r) -> None:
            f = np.float32(1.0 - r.lr * weight_decay)
            for a, b in spans:
                net.flat[a:b] *= f

        decay = {"on_images": shrink, "every": rep.batch_size}
    t0 = time.perf_counter()
    x = None if aug is not None and clean_last < epochs else to_float(xtr)
    xt = to_float(xte)
    x_seen = to_float(xtr[:train_eval]) if train_eval else None  # scored unaugmented each epoch
    # a spec with bn layers: the population statistics, recomputed before each evaluation from
    # the images the Trainer's validation uses (the first of the training split, unaugmented)
    x_cal = to_float(xtr[: int(config.get("model.calibration-images"))])
    index = np.arange(len(xtr))
    curve, train_curve, average_curve, reached, images, train_seconds = [], [], [], None, 0, 0.0
    loss_curve: list[float] = []
    for e in range(epochs):
        distort = aug is not None and e < epochs - clean_last
        xe = aug.apply(xtr, index, seed=seed, epoch=e) if distort else x
        st = rep.train_images(
            xe, ytr, epochs=1, seed=seed + e, first_epoch=e, schedule=plan, **decay
        )
        images += st.images
        train_seconds += st.seconds
        loss_curve.append(round(float(st.loss), 5))
        net.calibrate(x_cal)
        acc = float(net.evaluate(xt, yte))
        curve.append(round(acc, 4))
        if train_eval:
            tr = float(net.evaluate(x_seen, ytr[:train_eval]))
            train_curve.append(round(tr, 5))
        if average is not None and average.add(e, net.flat):
            mean = average.applied_to(net)
            mean.calibrate(x_cal)
            average_curve.append(round(float(mean.evaluate(xt, yte)), 4))
        print(
            f"engine epoch {e + 1}: test accuracy {acc:.4f}"
            + (f", train {train_curve[-1]:.5f}" if train_eval else "")
            + (f", tail average {average_curve[-1]:.4f}" if average_curve else ""),
            file=sys.stderr,
            flush=True,
        )
        if acc >= target:
            reached = time.perf_counter() - t0
            break
    return {
        "seconds_to_target": reached,
        "epochs": len(curve),
        "curve": curve,
        "train_curve": train_curve,
        "loss_curve": loss_curve,
        "average_curve": average_curve,
        "seconds": time.perf_counter() - t0,
        "images_per_second": images / train_seconds if train_seconds else None,
        "augment": aug is not None,
        "activation": net.activation,
    }


def main() -> None:
    from _common import (
        load_mnist_arrays,
        mnist_subset_store,
        record,
        torch_fit_to_target,
        train_cli,
    )

    from adam_dask import config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument(
        "--epochs", type=int, default=None, help="the planned epochs (default adam.train.epochs)"
    )
    ap.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="PyTorch threads")
    ap.add_argument(
        "--torch-lr",
        type=float,
        default=0.1,
        help="PyTorch's learning rate (its own recipe: 0.1 x0.7 per epoch reached 99%% "
        "fastest of those tried here)",
    )
    ap.add_argument("--torch-lr-decay", type=float, default=0.7)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-alone run")
    ap.add_argument(
        "--images",
        type=int,
        default=60000,
        help="MNIST training images (default all 60000; fewer only for a smoke run)",
    )
    args = ap.parse_args()
    store = mnist_subset_store(args.images)
    epochs = int(config.get("train.epochs", args.epochs))
    load_before = os.getloadavg()[0]

    history, ours, wall = train_cli(
        store, "--target-accuracy", str(args.target), "--epochs", str(epochs)
    )
    out = {
        "target": args.target,
        "planned_epochs": epochs,
        "ours_seconds_to_target": ours.get("seconds_to_target"),
        "ours_wall_seconds": round(wall, 2),
        "ours_epochs": ours["epochs"],
        "ours_test_accuracy": ours["test_accuracy"],
        "ours_images_per_second": ours["images_per_second"],
        "ours_replicas": ours["replicas"],
        "ours_curve": [round(r["test_accuracy"], 4) for r in history],
        "lr": config.get("train.lr"),
        "lr_schedule": config.get("train.lr-schedule"),
        "lr_floor": config.get("train.lr-floor"),
        "activation": config.get("model.activation"),
        "batch_size": config.get("train.batch-size"),
    }
    if args.images < 60000:
        out["images"] = args.images
    xtr, ytr, xte, yte = load_mnist_arrays(store)
    if not args.no_engine:
        trainers, threads = cluster_trainers()
        replicas = int(ours.get("replicas") or trainers)
        eng = engine_fit_to_target(
            xtr, ytr, xte, yte, target=args.target, epochs=epochs, threads=replicas * threads
        )
        out.update(
            engine_seconds_to_target=eng["seconds_to_target"]
            and round(eng["seconds_to_target"], 2),
            engine_epochs=eng["epochs"],
            engine_curve=eng["curve"],
            engine_threads=replicas * threads,
            engine_images_per_second=eng["images_per_second"],
            engine_augment=eng["augment"],
        )
    if not args.no_torch:
        try:
            th = torch_fit_to_target(
                xtr,
                ytr,
                xte,
                yte,
                target=args.target,
                max_epochs=epochs,
                threads=args.threads,
                lr=args.torch_lr,
                lr_decay=args.torch_lr_decay,
                activation=config.get("model.activation"),
            )
            out.update(
                torch_seconds_to_target=th["seconds_to_target"]
                and round(th["seconds_to_target"], 2),
                torch_epochs=th["epochs"],
                torch_curve=th["curve"],
                torch_threads=args.threads,
            )
            if th["seconds_to_target"] and ours.get("seconds_to_target"):
                out["speedup_vs_torch"] = round(
                    th["seconds_to_target"] / ours["seconds_to_target"], 3
                )
        except ImportError as exc:
            out["torch_error"] = f"PyTorch is not installed ({exc}); pip install '.[bench]'"
    ours_s = ours.get("seconds_to_target")
    for peer in ("torch", "engine"):
        theirs = out.get(f"{peer}_seconds_to_target")
        if ours_s and theirs:
            out[f"ours_over_{peer}"] = round(ours_s / theirs, 3)
    # issue 28's goals: the time to the target at most 0.6x PyTorch's; the system's images/s at
    # least 0.8x its engine's (issue 12 had asked 0.5x and 1.35x the engine's time)
    out["goals"] = {"ours_over_torch": 0.6, "images_per_second_vs_engine": 0.8}
    if out.get("ours_images_per_second") and out.get("engine_images_per_second"):
        out["images_per_second_vs_engine"] = round(
            out["ours_images_per_second"] / out["engine_images_per_second"], 4
        )
    out["load"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    record("time_to_accuracy", out, save=not args.no_save)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
