"""Training-engine throughput against PyTorch on CPU, and single-process MNIST accuracy.

    python benchmarks/engine.py --images 20000 --threads 2        # throughput line
    python benchmarks/engine.py --epochs 3                        # + test_accuracy after 3 epochs
    python benchmarks/engine.py --granularity                     # images/s per batch size

Prints one JSON line. Throughput: the paper's MNIST network
(conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc400,fc400,fc10, tanh) trained on real MNIST images,
forward + backward + update, by a HogwildReplica with T threads (``images_per_s``) and with one
thread (``images_per_s_1thread``), against the same network in PyTorch (``torch.set_num_threads(T)``,
SGD, batch 32: ``torch_images_per_s``). MNIST comes from $ADAM_DASK_MNIST (a folder with the four
``*-ubyte.gz`` files), else a shared/datasets/mnist folder beside the checkout, else the public
mirror.

The accuracy run (--epochs) trains the same layers with relu (--activation; tanh reaches about
99.0% with the same schedule, relu 99.1-99.2%), plain SGD, lr 0.05 on the package's schedule
over the --epochs planned (adam.train.lr-schedule, lr-floor; --lr-schedule, --lr-floor), no
augmentation, and evaluates on the 10000 test images after each epoch. PyTorch is optional
(``pip install .[bench]``); without it the torch fields are null and ``torch_error`` says why.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time

import numpy as np
from _common import record

from adam_dask.model import Network
from adam_dask.model import kernels as K
from adam_dask.train.replica import HogwildReplica
from adam_dask.train.schedule import Schedule

SPEC = "conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc400,fc400,fc10"


def load_mnist():
    """The four MNIST files ($ADAM_DASK_MNIST, shared/datasets/mnist, or the public mirror)."""
    from adam_dask.data.ingest import MNIST_FILES, mnist_location, read_idx

    root = mnist_location()
    (tri, trl), (tei, tel) = MNIST_FILES["train"], MNIST_FILES["test"]
    return (
        read_idx(f"{root}/{tri}"),
        read_idx(f"{root}/{trl}").astype(np.int64),
        read_idx(f"{root}/{tei}"),
        read_idx(f"{root}/{tel}").astype(np.int64),
    )


def ours(x, y, images, threads, batch_size, lr=0.01, repeats=2, spec=SPEC, activation="tanh"):
    """Best images/s of ``repeats`` runs over ``images`` images (compile warm-up first), of
    the network ``spec`` with ``activation`` (default the paper's, tanh)."""
    net = Network.from_spec(spec, (1, 28, 28), activation, seed=0)
    rep = HogwildReplica(net, threads=threads, lr=lr, momentum=0.0, batch_size=batch_size)
    rep.train_images(x[:256], y[:256], schedule=False)  # compile / warm up
    n = min(images, len(x))
    best = 0.0
    for r in range(repeats):
        st = rep.train_images(x[:n], y[:n], seed=r, schedule=False)
        best = max(best, st.images_per_second)
    return best


def hogwild_rate(x, y, images, threads, batch_size, fused, lr=0.01, repeats=2):
    """Best images/s of ``repeats`` runs of ``threads`` Hogwild threads over ``images`` images,
    each thread stepping its mini-batches with the fused step or the layered one; and the best
    images per CPU second of the threads (their own CPU time: less sensitive to other
    processes' load than the wall-clock rate)."""
    net = Network.from_spec(SPEC, (1, 28, 28), "tanh", seed=0)
    c, h, w = net.input_shape
    bs = batch_size
    ctxs = [net.context(bs) for _ in range(threads)]
    xbufs = [np.zeros((bs, c, h, w), np.float32) for _ in range(threads)]
    ybufs = [np.zeros(bs, np.int64) for _ in range(threads)]
    vel = np.zeros(1, np.float32)
    flat = net.flat

    cpu = [0.0] * threads

    def body(t, order, counter):
        ctx, xb, yb = ctxs[t], xbufs[t], ybufs[t]
        c0 = time.thread_time()
        while True:
            s = next(counter) * bs  # itertools.count: atomic under the GIL
            if s >= len(order):
                cpu[t] = time.thread_time() - c0
                return
            idx = order[s : s + bs]
            m = len(idx)
            np.take(x, idx, axis=0, out=xb[:m])
            np.take(y, idx, out=yb[:m])
            if fused:
                net.step_into(ctx, xb, yb, m, lr, 0.0, vel)
            else:
                net.backward_into(ctx, xb, yb, m)
                K.sgd_update(flat, ctx.grad, vel, lr, 0.0)

    def run(n, seed):
        order = np.random.default_rng(seed).permutation(len(x))[:n]
        counter = itertools.count()
        ts = [threading.Thread(target=body, args=(t, order, counter)) for t in range(threads)]
        t0 = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        return n / (time.perf_counter() - t0), n / sum(cpu)

    run(256, 0)  # compile / warm up
    runs = [run(min(images, len(x)), r + 1) for r in range(repeats)]
    return max(r[0] for r in runs), max(r[1] for r in runs)


def python_us_per_step(batch_size, repeats=2000):
    """Microseconds per mini-batch spent outside the kernels' work, where the GIL is held: the
    best time of each step on a network with the paper's layer kinds and count but 1x1
    convolutions on 4x4 images and two-unit dense layers, so its kernels do almost nothing.
    Robust to a busy machine (the minimum of many calls), unlike the scaling runs."""
    net = Network.from_spec(
        "conv1x1:1,maxpool2,conv1x1:1,maxpool2,fc2,fc2,fc2", (1, 4, 4), "tanh", seed=0
    )
    ctx = net.context(batch_size)
    rng = np.random.default_rng(0)
    xb = rng.random((batch_size, 1, 4, 4), dtype=np.float32)
    yb = rng.integers(0, 2, batch_size).astype(np.int64)
    vel = np.zeros(1, np.float32)

    def fused():
        net.step_into(ctx, xb, yb, batch_size, 1e-3, 0.0, vel)

    def layered():
        net.backward_into(ctx, xb, yb, batch_size)
        K.sgd_update(net.flat, ctx.grad, vel, 1e-3, 0.0)

    out = {}
    for name, f in (("fused", fused), ("layered", layered)):
        f()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        out[name] = round(best * 1e6, 1)
    return out


def scaling(x, y, images, threads, batch_size):
    """images/s of the fused and layered steps at 1..threads threads, the measurements
    interleaved so that a change in the machine's load hits both alike."""
    out: dict = {"fused": {}, "layered": {}, "fused_per_cpu_s": {}, "layered_per_cpu_s": {}}
    for t in range(1, threads + 1):
        for name in ("fused", "layered"):
            rate, per_cpu = hogwild_rate(x, y, images, t, batch_size, name == "fused")
            out[name][str(t)] = round(rate, 1)
            out[f"{name}_per_cpu_s"][str(t)] = round(per_cpu, 1)
    for name in ("fused", "layered"):
        r = out[name]
        out[f"thread_scaling_{name}"] = round(r[str(threads)] / r["1"], 3)
        # CPU efficiency at T threads against 1: what T free cores would give, before GIL waits
        c = out[f"{name}_per_cpu_s"]
        out[f"cpu_efficiency_{name}"] = round(c[str(threads)] / c["1"], 3)
    out["fused_speedup_1thread"] = round(out["fused"]["1"] / out["layered"]["1"], 3)
    out["python_us_per_step"] = python_us_per_step(batch_size)
    return out


def torch_net(torch):
    nn = torch.nn
    return nn.ModuleDict(
        {
            "0": nn.Conv2d(1, 10, 5),
            "2": nn.Conv2d(10, 20, 5),
            "4": nn.Linear(320, 400),
            "5": nn.Linear(400, 400),
            "6": nn.Linear(400, 10),
        }
    )


def torch_forward(torch, m, x):
    t = torch.tanh
    f = torch.nn.functional
    h = f.max_pool2d(t(m["0"](x)), 2)
    h = f.max_pool2d(t(m["2"](h)), 2)
    h = t(m["4"](h.flatten(1)))
    h = t(m["5"](h))
    return m["6"](h)


def theirs(x, y, images, threads, batch=32, lr=0.01, repeats=2):
    """PyTorch images/s (same network, SGD, batch 32, set_num_threads(threads)); also checks that
    our weights load into it by name and give the same logits."""
    import torch

    torch.set_num_threads(threads)
    m = torch_net(torch)
    ref = Network.from_spec(SPEC, (1, 28, 28), "tanh", seed=0)
    m.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in ref.parameters.items()})
    probe = x[:64]
    with torch.no_grad():
        diff = float(
            np.abs(
                torch_forward(torch, m, torch.from_numpy(probe)).numpy() - ref.forward(probe)
            ).max()
        )
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    lossf = torch.nn.CrossEntropyLoss()
    n = min(images, len(x)) // batch * batch
    X, Y = torch.from_numpy(x[:n]), torch.from_numpy(y[:n])
    best = 0.0
    for r in range(repeats + 1):  # first run warms up
        perm = torch.randperm(n)
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            idx = perm[s : s + batch]
            opt.zero_grad()
            lossf(torch_forward(torch, m, X[idx]), Y[idx]).backward()
            opt.step()
        if r:
            best = max(best, n / (time.perf_counter() - t0))
    return best, diff


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--images", type=int, default=20000, help="images per timed run (default 20000)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="Hogwild / torch threads (default 2); the scaling line measures 1..threads",
    )
    ap.add_argument(
        "--no-scaling", action="store_true", help="skip the fused / layered scaling line"
    )
    ap.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per-thread mini-batch (default: config adam.train.batch-size)",
    )
    ap.add_argument(
        "--epochs",
        type=int,
        default=0,
        help="also train this many epochs on all 60000 images and report test_accuracy",
    )
    ap.add_argument("--lr", type=float, default=0.05, help="accuracy run: learning rate (0.05)")
    ap.add_argument("--momentum", type=float, default=0.0, help="accuracy run: momentum (0)")
    ap.add_argument(
        "--lr-schedule",
        default=None,
        help="accuracy run: schedule over --epochs (default: config adam.train.lr-schedule)",
    )
    ap.add_argument(
        "--lr-floor",
        type=float,
        default=None,
        help="accuracy run: final lr as a fraction of --lr (default: config adam.train.lr-floor)",
    )
    ap.add_argument(
        "--activation",
        default="relu",
        help="accuracy run: relu (default; 99.1-99.2%% in 3 epochs) or tanh (99.0%%)",
    )
    ap.add_argument("--seed", type=int, default=0, help="accuracy run: init and shuffle seed")
    ap.add_argument(
        "--granularity",
        action="store_true",
        help="also measure images/s for per-thread batch sizes 1, 2, 4, 8, 16, 32",
    )
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    args = ap.parse_args(argv)

    from adam_dask import config

    bs = int(config.get("train.batch-size", args.batch_size))
    xtr8, ytr, xte8, yte = load_mnist()
    xtr = (xtr8.astype(np.float32) / 255)[:, None]
    out: dict = {
        "spec": SPEC,
        "threads": args.threads,
        "batch_size": bs,
        "images": min(args.images, len(xtr)),
        "load": [round(v, 2) for v in os.getloadavg()],
    }
    if args.images > 0 and not args.no_scaling:
        out.update(scaling(xtr, ytr, args.images, args.threads, bs))
    if args.images > 0:
        out["images_per_s"] = round(ours(xtr, ytr, args.images, args.threads, bs), 1)
        out["images_per_s_1thread"] = round(ours(xtr, ytr, args.images, 1, bs), 1)
        out["thread_scaling"] = round(out["images_per_s"] / out["images_per_s_1thread"], 3)
        out["torch_images_per_s"] = out["ratio"] = out["torch_logits_max_diff"] = None
        if not args.no_torch:
            try:
                tps, diff = theirs(xtr, ytr, args.images, args.threads)
                out["torch_images_per_s"] = round(tps, 1)
                out["ratio"] = round(out["images_per_s"] / tps, 3)
                out["torch_logits_max_diff"] = float(f"{diff:.3g}")
            except ImportError as e:
                out["torch_error"] = (
                    f"PyTorch is not installed ({e}); pip install torch==2.13.0 "
                    "(or .[bench]) to compare"
                )
                print("warning: " + out["torch_error"], file=sys.stderr)
    if args.granularity:
        out["granularity_images_per_s"] = {
            str(b): round(ours(xtr, ytr, min(args.images, 8000), args.threads, b, repeats=3), 1)
            for b in (1, 2, 4, 8, 16, 32)
        }
    if args.epochs:
        net = Network.from_spec(SPEC, (1, 28, 28), args.activation, seed=args.seed)
        plan = Schedule.from_config(
            lr=args.lr, epochs=args.epochs, kind=args.lr_schedule, floor=args.lr_floor
        )
        rep = HogwildReplica(
            net,
            threads=args.threads,
            momentum=args.momentum,
            batch_size=bs,
            schedule=plan,
        )
        curve = []
        st = rep.train_images(
            xtr8,
            ytr,
            epochs=args.epochs,
            seed=args.seed,
            on_epoch=lambda r, e, s: curve.append(
                {
                    "epoch": e + 1,
                    "lr": round(r.lr, 5),
                    "train_loss": round(s.loss, 4),
                    "test_accuracy": round(r.net.evaluate(xte8, yte), 4),
                    "seconds": round(s.seconds, 1),
                }
            ),
        )
        out.update(
            {
                "epochs": args.epochs,
                "activation": net.activation,
                "lr": plan.lr,
                "lr_schedule": plan.kind,
                "lr_floor": plan.floor,
                "momentum": rep.momentum,
                "train_seconds": round(st.seconds, 1),
                "train_images_per_s": round(st.images_per_second, 1),
                "test_accuracy": curve[-1]["test_accuracy"],
                "curve": curve,
            }
        )
    out["load_after"] = [round(v, 2) for v in os.getloadavg()]
    record("engine", out, save=not args.no_save)


if __name__ == "__main__":
    main()
