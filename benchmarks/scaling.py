"""Benchmark (issue 47): how ``adam-dask train`` uses the machine it runs on, in one run.

Prints one JSON line and appends it to ``benchmarks/results/scaling.jsonl``. In this order, on
the same cores, each training run stopping at the first epoch at or above ``--target`` (default
0.99) or after ``--epochs`` (default ``adam.train.epochs``):

* the engine alone: one ``HogwildReplica`` with a thread per core, the configured network and
  mini-batch, images/s over ``--engine-images`` training images (``engine.py``'s ``ours``: the
  best of 2 runs after a warm-up): ``engine_images_per_second``. First, as it also compiles the
  network's kernels into numba's cache on disk: no CLI run below pays for that.
* ``config: "defaults"``: the real CLI on the embedded cluster as sized by the machine (no
  ``--trainers`` / ``--threads``): ``replicas`` and ``threads`` (from its history), the DATA
  workers it was sized with (``data_nodes``), test ``accuracy``, ``images_per_second`` and
  ``stall_fraction`` per epoch, ``epochs_to_target`` and ``seconds_to_target`` (from the start of
  training, as the CLI's result line counts them; null when the target was not reached);
  ``push_images``, ``exchange_seconds`` and ``damping_min`` per epoch (images per push, seconds
  per push and pull, the lowest damping of a replica's rate for pushing less often than
  planned: ``PushPace``); ``images_per_second_vs_engine``: its median images/s over the epochs after the first (the
  first alone when only one ran; ``images_per_second_epochs`` says which) over the engine's.
* ``peer: "ddp"``: PyTorch DistributedDataParallel, gloo on CPU, P processes x t threads filling
  the same cores (P the replicas the defaults ran, t = cores // P, at least 1), the same network
  (``_common.torch_model``), each process a ``DistributedSampler`` shard of the same MNIST store,
  SGD with a mini-batch of 32 per process, the test set scored on rank 0 after each epoch.
  ``peer_seconds_to_target`` counts from the start of training (the processes started, the data
  loaded, a barrier passed), evaluations included, as ``peer_seconds_per_epoch`` does.
  The recipe (``peer_recipe``; ``--peer-*`` flags): DDP averages the P gradients, so a step is
  SGD on 32 P images. Its single-process equivalent (full MNIST, seed 0, at most 4-6 epochs)
  chose it: at P = 8 (a batch of 256), plain SGD at 0.8 (0.1, PyTorch's best rate for a batch of
  32 in ``time_to_accuracy.py``, x P) diverged, with a first-epoch warm-up it reached 97.7% in 4
  epochs, at 0.28 (x sqrt(P)) 98.8% in 5; momentum 0.9 at 0.01 x P, climbing from 0.01 over the
  first epoch, then x0.7 per epoch, reached 99% in 4 (x0.6 or x0.8 per epoch, or a peak of
  0.12: in 6; x0.5: 98.9% after 6). At P = 4 the same recipe took 6 epochs (5 with x0.5), at P = 1 (no
  warm-up) 3, as plain SGD at 0.1 does. Large batches need more epochs: that is DDP's cost here.
* ``sweep``: the CLI again for each R of ``--sweep`` (default 1,2,4,8) with ``--trainers R
  --threads max(1, cores // R)``: where R exceeds the cores, one thread each, the emulation of R
  asynchronous replicas on fewer cores. Each entry: replicas, threads, epochs_to_target,
  seconds_to_target, images_per_second (the median over the epochs after the first), accuracy
  per epoch, stall_fraction (the median over the epochs), push_images, exchange_seconds and
  damping_min per epoch.

Stamps: ``cpus`` (os.cpu_count()), ``cores`` (the cores this process may use, what the cluster is
sized from), ``cpu_model``, ``load`` (the 1-minute load average before and after), ``target``,
``epochs``, ``missing`` (what did not run, and why), and ``goals``, each judged from the line
(null where it measured nothing to judge by): ``defaults_reach_target``,
``seconds_vs_peer_le_0_5`` (ours seconds to the target at most half DDP's),
``sweep_all_within_4_epochs``, ``stall_le_0_1`` (the defaults' median stall fraction over its
epochs at most 0.1), ``images_per_second_vs_engine_ge_0_8``.

Needs no network: MNIST from ``--mnist`` or ``_common.mnist_store()`` (local files); without
PyTorch (``pip install ".[bench]"``) the peer's fields are null and ``missing`` says "torch".
Progress goes to stderr.

    python benchmarks/scaling.py [--target 0.99] [--epochs 10] [--sweep 1,2,4,8] [--no-peer]
        [--max-epochs-peer N] [--mnist STORE] [--no-save]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

# DDP's recipe (see the module's docstring for why)
PEER = {"lr": 0.01, "scaling": "linear", "momentum": 0.9, "decay": 0.7}
GOALS = {
    "seconds_vs_peer": 0.5,  # at most
    "sweep_epochs": 4,  # at most, every replica count of the sweep
    "stall": 0.1,  # at most
    "images_per_second_vs_engine": 0.8,  # at least
}


def say(msg: str) -> None:
    print(f"scaling: {msg}", file=sys.stderr, flush=True)


# --- what the machine and the configuration size ---


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), or None where it is not there."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None


def data_nodes() -> int | None:
    """The embedded cluster's DATA workers as sized on this machine: counted in the cluster's
    own spec (``adam_dask.cluster.local_spec``), else ``adam.cluster.data-nodes`` when it is a
    number, else ``adam_dask.sizing.size_data_nodes`` (called with what it asks for of cores,
    trainers and memory) when sizing has one; None when none of these answers."""
    from adam_dask import cluster, config, sizing

    try:
        _, workers = cluster.local_spec(dashboard_address="none")
        return sum(1 for w in workers.values() if cluster.DATA in w["options"].get("resources", {}))
    except Exception as exc:  # the spec's shape changed: read the setting instead
        say(f"cluster.local_spec gave no DATA count ({exc!r}); reading the setting")
    value = config.get("cluster.data-nodes")
    if str(value).lower() != sizing.AUTO:
        try:
            return int(value)
        except (TypeError, ValueError):
            return None
    size = getattr(sizing, "size_data_nodes", None)
    if size is None:
        return None
    cores = sizing.machine_cores()
    known = {
        "cores": cores,
        "trainers": sizing.size_trainers(cores)[0],
        "memory": sizing.machine_memory,
    }
    kwargs = {}
    for name, p in inspect.signature(size).parameters.items():
        if name in known:
            v = known[name]
            kwargs[name] = v() if callable(v) else v
        elif p.default is inspect.Parameter.empty:
            return None
    try:
        return int(size(**kwargs))
    except (TypeError, ValueError):
        return None


def sized_trainers() -> tuple[int, int]:
    """(trainers, threads each) of the embedded cluster as configured and sized."""
    from time_to_accuracy import cluster_trainers

    return cluster_trainers()


# --- ours: the CLI ---


def _median(v: list[float]) -> float | None:
    return statistics.median(v) if v else None


def _round(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(float(v), digits)


def cli_run(store: str, target: float, epochs: int, *flags: str) -> dict:
    """``adam-dask train`` to ``target`` (at most ``epochs``) with ``flags``: what its history
    and result line say (``error`` and nothing else when it failed)."""
    from _common import train_cli

    try:
        history, result, wall = train_cli(
            store, "--target-accuracy", str(target), "--epochs", str(epochs), *flags
        )
    except SystemExit as exc:  # train_cli exits with the CLI's last error lines
        return {"error": str(exc.code)}
    accuracy = [r["test_accuracy"] for r in history]
    reached = next((i + 1 for i, a in enumerate(accuracy) if a >= target), None)
    rates = [r["images_per_second"] for r in history]
    later = rates[1:] or rates
    threads = sorted({t for r in history for t in r.get("replica_threads") or []})
    stall = [r["stall_fraction"] for r in history if "stall_fraction" in r]
    return {
        # images per push (a push due while one is in flight joins the next) and the lowest
        # damping of a replica's rate for pushing less often than planned, per epoch
        "push_images": [_round(r.get("push_images")) for r in history],
        "exchange_seconds": [_round(r.get("exchange_seconds"), 4) for r in history],
        "damping_min": [_round(min(r.get("replica_damping") or [1.0]), 3) for r in history],
        "replicas": result.get("replicas") or (history[-1]["replicas"] if history else None),
        "threads": threads[0] if len(threads) == 1 else (threads or None),
        "accuracy": accuracy,
        "images_per_second": rates,
        "images_per_second_median": _median(later),
        "images_per_second_epochs": list(range(2, len(rates) + 1)) if rates[1:] else [1],
        "stall_fraction": stall or None,
        "epochs_to_target": reached,
        "seconds_to_target": result.get("seconds_to_target"),
        "wall_seconds": wall,
    }


# --- the engine alone ---


def engine_rate(store: str, threads: int, images: int) -> float:
    """Training images/s of one HogwildReplica of ``threads`` threads over ``images`` images
    of the store, the configured network and mini-batch (``engine.ours``)."""
    import engine
    from _common import load_mnist_arrays

    from adam_dask import config

    xtr, ytr, _, _ = load_mnist_arrays(store)
    return engine.ours(
        xtr,
        ytr,
        images,
        threads,
        int(config.get("train.batch-size")),
        spec=config.get("model.spec"),
        activation=config.get("model.activation"),
    )


# --- the peer: PyTorch DDP ---


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_worker(
    rank: int,
    world: int,
    port: int,
    store: str,
    threads: int,
    target: float,
    epochs: int,
    recipe: dict,
    activation: str,
    out: str,
) -> None:
    """One DDP process: its shard of the training set each epoch, rank 0 scoring the test set
    after each and telling every rank whether to stop; rank 0 writes its record to ``out``."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from _common import load_mnist_arrays, torch_accuracy, torch_model
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        xtr, ytr, xte, yte = load_mnist_arrays(store)
        X = torch.from_numpy(xtr[:, None].astype(np.float32) / 255)
        Y = torch.from_numpy(ytr)
        Xt = torch.from_numpy(xte[:, None].astype(np.float32) / 255) if rank == 0 else None
        torch.manual_seed(0)
        model = DistributedDataParallel(torch_model(torch, activation))  # rank 0's weights
        peak, warm_from = recipe["lr"], recipe["warm_up_from"]
        opt = torch.optim.SGD(model.parameters(), lr=peak, momentum=recipe["momentum"])
        lossf = torch.nn.CrossEntropyLoss()
        sampler: DistributedSampler = DistributedSampler(
            TensorDataset(Y), num_replicas=world, rank=rank, seed=0
        )
        batch = 32
        dist.barrier()
        t0 = time.perf_counter()
        curve: list[float] = []
        epoch_seconds: list[float] = []
        reached, train_seconds, images = None, 0.0, 0
        for e in range(epochs):
            t_epoch = time.perf_counter()
            sampler.set_epoch(e)
            order = torch.tensor(list(sampler))
            model.train()
            for i in range(0, len(order), batch):
                # the first epoch climbs from warm_up_from to the peak, then x decay per epoch
                lr = peak * recipe["decay"] ** e
                if e == 0 and warm_from is not None:
                    lr = warm_from + (peak - warm_from) * i / len(order)
                for g in opt.param_groups:
                    g["lr"] = lr
                idx = order[i : i + batch]
                opt.zero_grad()
                lossf(model(X[idx]), Y[idx]).backward()
                opt.step()
            train_seconds += time.perf_counter() - t_epoch
            images += len(order) * world  # every rank trains as many (the sampler pads)
            stop = torch.zeros(1)
            if rank == 0:
                acc = torch_accuracy(torch, model.module, Xt, yte)
                curve.append(round(acc, 4))
                epoch_seconds.append(time.perf_counter() - t_epoch)
                print(f"scaling: ddp epoch {e + 1}: test accuracy {acc:.4f}", file=sys.stderr)
                if acc >= target:
                    reached = time.perf_counter() - t0
                    stop[0] = 1
            dist.broadcast(stop, 0)
            if stop.item():
                break
        if rank == 0:
            with open(out, "w") as f:
                json.dump(
                    {
                        "accuracy": curve,
                        "epochs_to_target": len(curve) if reached is not None else None,
                        "seconds_to_target": reached,
                        "seconds_per_epoch": epoch_seconds,
                        "images_per_second": images / train_seconds if train_seconds else None,
                        "torch": torch.__version__,
                    },
                    f,
                )
    finally:
        dist.destroy_process_group()


def ddp_run(
    store: str,
    processes: int,
    threads: int,
    *,
    target: float,
    epochs: int,
    recipe: dict,
) -> dict:
    """Train with PyTorch DDP (``processes`` x ``threads``): rank 0's record; ``error`` when
    the run failed."""
    import torch.multiprocessing as mp

    from adam_dask import config

    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback: no network needed, none asked
    out = os.path.join(tempfile.mkdtemp(prefix="adam-scaling-ddp-"), "rank0.json")
    args = (
        processes,
        free_port(),
        store,
        threads,
        target,
        epochs,
        recipe,
        str(config.get("model.activation")),
        out,
    )
    try:
        mp.spawn(_ddp_worker, args=args, nprocs=processes, join=True)
        with open(out) as f:
            return json.load(f)
    except Exception as exc:  # a rank failed: the line says so
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"}


# --- the line ---


def goals(line: dict) -> dict[str, bool | None]:
    """Each goal of issue 47 judged from ``line``; None where the line measured nothing to
    judge it by."""

    def le(v: Any, bound: float) -> bool | None:
        return None if v is None else bool(v <= bound)

    sweep = line.get("sweep") or []
    stall = line.get("stall_fraction")
    ratio = line.get("images_per_second_vs_engine")
    return {
        "defaults_reach_target": (
            None if line.get("accuracy") is None else line.get("epochs_to_target") is not None
        ),
        "seconds_vs_peer_le_0_5": le(line.get("seconds_vs_peer"), GOALS["seconds_vs_peer"]),
        "sweep_all_within_4_epochs": (
            all_reached(sweep)
            if sweep and (not line.get("incomplete") or not all_reached(sweep))
            else None
        ),
        "stall_le_0_1": le(_median(stall) if stall else None, GOALS["stall"]),
        "images_per_second_vs_engine_ge_0_8": (
            None if ratio is None else bool(ratio >= GOALS["images_per_second_vs_engine"])
        ),
    }


def all_reached(sweep: list[dict]) -> bool:
    """Every entry reached the target within the goal's epochs (a cut sweep that missed once
    has missed; one that has not can not yet say)."""
    return all(
        s.get("epochs_to_target") is not None and s["epochs_to_target"] <= GOALS["sweep_epochs"]
        for s in sweep
    )


def parse_sweep(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give replica counts, e.g. 1,2,4,8") from None
    if any(r < 1 for r in out):
        raise argparse.ArgumentTypeError(f"{text!r}: a replica count is at least 1")
    return out


def main(argv: list[str] | None = None) -> int:
    from _common import mnist_store, record

    from adam_dask import config, sizing

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=0.99, help="test accuracy to reach (0.99)")
    ap.add_argument(
        "--epochs", type=int, default=None, help="at most this many (default adam.train.epochs)"
    )
    ap.add_argument(
        "--sweep",
        type=parse_sweep,
        default=[1, 2, 4, 8],
        help="replica counts to run with --trainers R --threads max(1, cores // R) "
        "(default 1,2,4,8; '' skips the sweep)",
    )
    ap.add_argument("--no-peer", action="store_true", help="skip PyTorch DDP")
    ap.add_argument(
        "--max-epochs-peer", type=int, default=None, help="DDP's epochs at most (default --epochs)"
    )
    ap.add_argument(
        "--peer-lr",
        type=float,
        default=PEER["lr"],
        help=f"DDP's learning rate for a batch of 32 ({PEER['lr']:g}), scaled by "
        "--peer-lr-scaling for the P processes' batch of 32 P",
    )
    ap.add_argument(
        "--peer-lr-scaling",
        choices=("linear", "sqrt"),
        default=PEER["scaling"],
        help=f"the peak rate: --peer-lr x P or x sqrt(P) ({PEER['scaling']})",
    )
    ap.add_argument(
        "--peer-momentum", type=float, default=PEER["momentum"], help=f"({PEER['momentum']:g})"
    )
    ap.add_argument(
        "--peer-lr-decay",
        type=float,
        default=PEER["decay"],
        help=f"x this per epoch after the first ({PEER['decay']:g})",
    )
    ap.add_argument(
        "--no-peer-warm-up",
        action="store_true",
        help="start at the peak rate (default: climb from --peer-lr to it over the first epoch)",
    )
    ap.add_argument(
        "--engine-images", type=int, default=20000, help="images per engine-alone run (20000)"
    )
    ap.add_argument("--mnist", default=None, help="MNIST store (default _common.mnist_store())")
    ap.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    args = ap.parse_args(argv)

    epochs = int(config.get("train.epochs", args.epochs))
    cores = sizing.machine_cores()
    missing: list[str] = []
    load_before = os.getloadavg()[0]
    try:
        store = args.mnist or mnist_store()
        from adam_dask.data.datasets import open_split

        open_split(store, "train")
        open_split(store, "test")
    except Exception as exc:
        raise SystemExit(
            f"scaling: no MNIST store ({type(exc).__name__}: {exc}); give --mnist STORE (made by "
            "adam-dask ingest) or put the four MNIST files in $ADAM_DASK_MNIST"
        ) from None
    line: dict[str, Any] = {
        "config": "defaults",
        "target": args.target,
        "epochs": epochs,
        "cores": cores,
        "cpu_model": cpu_model(),
    }
    if args.mnist:
        line["mnist"] = args.mnist

    # the engine alone, first: it also compiles the network's kernels into numba's cache on
    # disk, so that no CLI run below pays for their compilation and the first does not alone
    say(f"engine alone: {cores} threads, {args.engine_images} images")
    line["engine_threads"] = cores
    line["engine_images"] = args.engine_images
    line["engine_images_per_second"] = engine_rate(store, cores, args.engine_images)

    # the defaults
    trainers, threads = sized_trainers()
    say(f"defaults: adam-dask train, cluster sized {trainers} x {threads} on {cores} cores")
    ours = cli_run(store, args.target, epochs)
    if "error" in ours:
        missing.append(f"defaults: adam-dask train failed: {ours['error']}")
        ours = {}
    line.update(
        replicas=ours.get("replicas") or trainers,
        threads=ours.get("threads") or threads,
        data_nodes=data_nodes(),
        accuracy=ours.get("accuracy"),
        images_per_second=ours.get("images_per_second"),
        images_per_second_median=ours.get("images_per_second_median"),
        images_per_second_epochs=ours.get("images_per_second_epochs"),
        stall_fraction=ours.get("stall_fraction"),
        epochs_to_target=ours.get("epochs_to_target"),
        seconds_to_target=ours.get("seconds_to_target"),
        wall_seconds=ours.get("wall_seconds"),
        push_images=ours.get("push_images"),
        exchange_seconds=ours.get("exchange_seconds"),
        damping_min=ours.get("damping_min"),
    )
    if line["data_nodes"] is None:
        missing.append("data_nodes: neither the cluster's spec nor the setting gave a count")
    say(f"defaults: accuracy {line['accuracy']}, {line['seconds_to_target']} s to {args.target:g}")

    med = line["images_per_second_median"]
    line["images_per_second_vs_engine"] = (
        med / line["engine_images_per_second"] if med and line["engine_images_per_second"] else None
    )

    # the peer: DDP
    P = int(line["replicas"])
    t = max(1, cores // P)
    scale = P if args.peer_lr_scaling == "linear" else math.sqrt(P)
    recipe = {
        "lr": args.peer_lr * scale,
        "warm_up_from": None if args.no_peer_warm_up or P == 1 else args.peer_lr,
        "momentum": args.peer_momentum,
        "decay": args.peer_lr_decay,
        "scaling": args.peer_lr_scaling,
        "batch_per_process": 32,
    }
    line.update(
        peer="ddp",
        peer_processes=P,
        peer_threads=t,
        peer_recipe=recipe,
        peer_accuracy=None,
        peer_epochs_to_target=None,
        peer_seconds_to_target=None,
        peer_seconds_per_epoch=None,
        peer_images_per_second=None,
        seconds_vs_peer=None,
    )
    if args.no_peer:
        missing.append("ddp: --no-peer")
    else:
        have_torch = True
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_gloo_available()):
                raise ImportError("this torch has no torch.distributed gloo backend")
        except ImportError as exc:
            missing.append(f"torch: {exc} (pip install '.[bench]')")
            have_torch = False
        if have_torch:
            say(f"ddp: {P} processes x {t} threads, peak lr {recipe['lr']:.3g}")
            peer = ddp_run(
                store,
                P,
                t,
                target=args.target,
                epochs=args.max_epochs_peer or epochs,
                recipe=recipe,
            )
            if "error" in peer:
                missing.append(f"ddp: {peer['error']}")
            else:
                line.update(
                    peer_accuracy=peer["accuracy"],
                    peer_epochs_to_target=peer["epochs_to_target"],
                    peer_seconds_to_target=peer["seconds_to_target"],
                    peer_seconds_per_epoch=peer["seconds_per_epoch"],
                    peer_images_per_second=peer["images_per_second"],
                    torch=peer["torch"],
                )
                if line["seconds_to_target"] and peer["seconds_to_target"]:
                    line["seconds_vs_peer"] = line["seconds_to_target"] / peer["seconds_to_target"]

    # the sweep; a SIGTERM (a time limit) ends it and the line is stored with what was measured
    sweep: list[dict] = []

    def _cut(signum: int, frame: Any) -> None:
        raise _Cut()

    signal.signal(signal.SIGTERM, _cut)
    try:
        _sweep(args, store, epochs, cores, sweep, missing)
    except _Cut:
        missing.append(f"sweep: cut short by SIGTERM after {len(sweep)} of {len(args.sweep)}")
        line["incomplete"] = True
    if sweep:
        line["sweep"] = sweep

    line["missing"] = missing
    line["load"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    line["goals"] = goals(line)
    record("scaling", line, save=not args.no_save)
    return 0


class _Cut(Exception):
    """SIGTERM arrived during the sweep."""


def _sweep(args: Any, store: str, epochs: int, cores: int, sweep: list, missing: list) -> None:
    """The CLI for each R of ``--sweep`` with ``--trainers R --threads max(1, cores // R)``,
    each entry appended to ``sweep`` as it ends."""
    for R in args.sweep:
        tr = max(1, cores // R)
        say(f"sweep: --trainers {R} --threads {tr}")
        run = cli_run(store, args.target, epochs, "--trainers", str(R), "--threads", str(tr))
        if "error" in run:
            missing.append(f"sweep {R} x {tr}: adam-dask train failed: {run['error']}")
            sweep.append({"replicas": R, "threads": tr, "error": run["error"]})
            continue
        stall = run["stall_fraction"]
        sweep.append(
            {
                "replicas": run["replicas"] or R,
                "threads": run["threads"] or tr,
                "epochs_to_target": run["epochs_to_target"],
                "seconds_to_target": run["seconds_to_target"],
                "images_per_second": run["images_per_second_median"],
                "accuracy": run["accuracy"],
                "stall_fraction": _median(stall) if stall else None,
                "push_images": run["push_images"],
                "exchange_seconds": run["exchange_seconds"],
                "damping_min": run["damping_min"],
            }
        )
        say(f"sweep {R} x {tr}: {run['epochs_to_target']} epochs to {args.target:g}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
