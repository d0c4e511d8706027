"""Benchmark: wall seconds for `adam-dask train` on real MNIST to reach a test accuracy, beside
the same network in PyTorch on CPU (SGD, batch 32, the same threads, and the learning-rate
schedule that reached the target fastest for it).

Prints one JSON line and appends it to benchmarks/results/time_to_accuracy.jsonl. Ours runs the
real CLI on the embedded cluster (its defaults), so the figure includes starting the cluster;
``ours_seconds_to_target`` counts from the start of training, as PyTorch's does. ``--epochs`` is
the run's plan (the learning-rate schedule anneals over it; default ``adam.train.epochs``); the
run stops at the first epoch at or above the target. Wall seconds on a shared machine are noisy:
``ours_epochs`` (epochs to the target) and ``load`` (1-minute load averages before and after)
say how to read them.

    python benchmarks/time_to_accuracy.py [--target 0.99] [--epochs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> None:
    from _common import load_mnist_arrays, mnist_store, record, torch_fit_to_target

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
    args = ap.parse_args()
    store = mnist_store()
    epochs = int(config.get("train.epochs", args.epochs))
    load_before = os.getloadavg()[0]

    metrics = os.path.join(tempfile.mkdtemp(prefix="adam-tta-"), "history.jsonl")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "adam_dask.cli",
            "train",
            "--data",
            store,
            "--target-accuracy",
            str(args.target),
            "--epochs",
            str(epochs),
            "--no-progress",
            "--metrics-out",
            metrics,
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"adam-dask train failed: {proc.stderr.strip().splitlines()[-1:]}")
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(metrics) as f:
        history = [json.loads(line) for line in f if line.strip()]
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
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if not args.no_torch:
        try:
            xtr, ytr, xte, yte = load_mnist_arrays(store)
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
    record("time_to_accuracy", out, save=not args.no_save)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
