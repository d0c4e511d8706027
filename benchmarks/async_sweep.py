"""The learning-rate rule for many asynchronous replicas, swept in one process (issue 47).

A cluster run of R replicas x T Hogwild threads costs a cluster's start and R x T cores; a sweep
over R = 1..16 and T = 1..16 does not fit a small machine that way. This script emulates the
same staleness in one process, deterministically, with the engine's own kernels and the real
MNIST, so every setting that decides statistical efficiency can be swept on any machine (and
many settings at once on a machine with many cores: ``--jobs``):

* R replicas, each with weights of its own. A replica's T Hogwild threads each take a
  mini-batch of ``batch-size`` images from the replica's share of the epoch, compute their
  gradients at the replica's current weights and then all apply them (T lock-free threads
  superpose their steps: each one's gradient misses the other T-1 steps, as on a real core
  each thread's does while the others write).
* Every ``push-every`` images a replica adds what its weights moved since its last push to the
  global weights (the parameter server's ``sum``; scaled by ``1 / (1 + tau)`` with
  ``+staleness``, ``tau`` the pushes applied since the replica read) and pulls them. Replicas
  take their steps in turn and start staggered by ``push-every / R`` images, so between two
  pulls of one replica the R - 1 others push once each: the staleness R replicas have when
  they run at one speed. ``--lag L``: the pull lands L of the replica's steps (T mini-batches
  each) after its push, with what the replica trained meanwhile kept (the exchange's round
  trip on a busy machine); 0, at once.
* The rate: the run's schedule (``adam.train.lr``, ``lr-schedule``, ``lr-floor``,
  ``lr-warmup`` over ``--epochs`` planned epochs) times the rule's factor for (R, T)
  (``--factor rule``: the defaults' plan, :func:`adam_dask.train.streams.stream_plan`, which
  also sets the push period and the warm-up).

After each epoch (60,000 images over all replicas) the global weights are scored on the test
set. One JSON line per setting goes to ``benchmarks/results/async_sweep.jsonl``: the setting,
the accuracy after each epoch, ``epochs_to_target`` and whether it diverged (chance accuracy or
a non-finite weight).

    python benchmarks/async_sweep.py --replicas 1,2,4,8,16 --threads 1,2 --jobs 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _data(store: str):
    from _common import load_mnist_arrays

    xtr, ytr, xte, yte = load_mnist_arrays(store)
    xtr = (xtr.astype(np.float32) / 255.0)[:, None]
    xte = (xte.astype(np.float32) / 255.0)[:, None]
    return xtr, ytr, xte, yte


def run_setting(setting: dict, store: str) -> dict:
    """Train one setting (see the module docstring) and return its record."""
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    from adam_dask import config
    from adam_dask.model import Network
    from adam_dask.model import kernels as K
    from adam_dask.train.schedule import Schedule

    xtr, ytr, xte, yte = _data(store)
    R, T = int(setting["replicas"]), int(setting["threads"])
    k, b = int(setting["push_every"]), int(setting["batch_size"])
    epochs, planned = int(setting["epochs"]), int(setting["planned_epochs"])
    target = float(setting["target"])
    staleness = bool(setting.get("staleness", False))
    server_mu = float(setting.get("server_momentum", 0.0))
    server_lr = float(setting.get("server_lr", 1.0))
    sched = Schedule(
        lr=float(setting["lr"]),
        epochs=planned,
        kind=str(setting.get("lr_schedule") or config.get("train.lr-schedule")),
        floor=float(setting.get("lr_floor") or config.get("train.lr-floor")),
        warmup=float(setting.get("lr_warmup", 0.0)),
    )
    factor = float(setting["factor"])
    spec = str(config.get("model.spec"))
    act = str(config.get("model.activation"))
    seed = int(setting.get("seed", 0))
    nets = [Network.from_spec(spec, (1, 28, 28), act, seed=seed) for _ in range(R)]
    glob = nets[0].flat.copy()
    base = [glob.copy() for _ in range(R)]
    mom = np.zeros_like(glob)
    lag = int(setting.get("lag", 0))
    pending: list[list[tuple]] = [[] for _ in range(R)]
    ticks = [0] * R
    ctxs = [[n.context(b) for _ in range(T)] for n in nets]
    vel = np.zeros(1, np.float32)
    version = 0
    read_version = [0] * R
    n = len(xtr)
    rng = np.random.default_rng(seed)
    curve: list[float] = []
    diverged = False
    t0 = time.perf_counter()
    done_images = 0
    # images since the last push, staggered so the replicas' pushes spread over a period
    since = [int(k * r / R) for r in range(R)]
    for epoch in range(epochs):
        order = rng.permutation(n)
        shares = np.array_split(order, R)
        pos = [0] * R
        active = list(range(R))
        while active:
            for r in list(active):
                net, share = nets[r], shares[r]
                lr = sched.at(done_images / n) * factor
                grads_done = 0
                for t in range(T):
                    s = pos[r]
                    if s >= len(share):
                        break
                    idx = share[s : s + b]
                    pos[r] = s + len(idx)
                    xb = np.ascontiguousarray(xtr[idx])
                    yb = ytr[idx]
                    if T == 1:
                        net.step_into(ctxs[r][0], xb, yb, len(idx), lr, 0.0, vel)
                    else:
                        net.backward_into(ctxs[r][t], xb, yb, len(idx))
                    grads_done += 1
                    since[r] += len(idx)
                    done_images += len(idx)
                if T > 1:
                    for t in range(grads_done):
                        K.sgd_update(net.flat, ctxs[r][t].grad, vel, lr, 0.0)
                if since[r] >= k or pos[r] >= len(share):
                    delta = net.flat - base[r]
                    scale = 1.0 / (1 + version - read_version[r]) if staleness else 1.0
                    if server_mu:
                        d = np.float32(scale) * delta
                        mom *= np.float32(server_mu)
                        mom += d
                        glob += np.float32(server_lr) * (d + np.float32(server_mu) * mom)
                    else:
                        glob += np.float32(scale) * delta
                    version += 1
                    if lag:  # the pull lands ``lag`` of this replica's steps later
                        pending[r].append((ticks[r] + lag, glob.copy(), net.flat.copy(), version))
                        base[r][:] = net.flat
                    else:
                        net.flat[:] = glob
                        base[r][:] = glob
                        read_version[r] = version
                    since[r] = 0
                ticks[r] += 1
                while pending[r] and pending[r][0][0] <= ticks[r]:
                    _, snap, at_take, v = pending[r].pop(0)
                    shift = snap - at_take  # the weights pulled, with this replica's steps since
                    net.flat += shift
                    base[r] += shift
                    read_version[r] = v
                if pos[r] >= len(share):
                    active.remove(r)
            if not np.isfinite(glob[:1000]).all():
                break
        if not np.isfinite(glob).all():
            diverged = True
            curve.append(0.0)
            break
        probe = nets[0]
        saved = probe.flat.copy()
        probe.flat[:] = glob
        acc = float(probe.evaluate(xte, yte))
        probe.flat[:] = saved
        curve.append(round(acc, 4))
        print(f"{setting['name']} epoch {epoch} {acc:.4f}", file=sys.stderr, flush=True)
        if acc < 0.2 and epoch >= 1:
            diverged = True
            break
        if acc >= target:
            break
    reached = next((i + 1 for i, a in enumerate(curve) if a >= target), None)
    return {
        **setting,
        "accuracy": curve,
        "epochs_to_target": reached,
        "diverged": diverged,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v]


def main(argv: list[str] | None = None) -> None:
    from _common import mnist_store, record

    from adam_dask import config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,2,4,8")
    p.add_argument("--threads", default="1")
    p.add_argument("--push-every", default="512", help="ignored where --factor is rule")
    p.add_argument("--lr", default=str(config.get("train.lr")))
    p.add_argument("--lr-warmup", default="0", help="ignored where --factor is rule")
    p.add_argument(
        "--factor",
        default="rule",
        help="per-replica rate factor(s): 'rule' (the default rule), or numbers, or "
        "'inv' (1/(R*T/2) legacy lr/R), comma-separated",
    )
    p.add_argument("--staleness", action="store_true")
    p.add_argument("--server-momentum", type=float, default=0.0, help="nesterov on the server")
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument(
        "--lag",
        type=int,
        default=0,
        help="a push's pull lands this many of the replica's steps later (its round trip; "
        "0: at once)",
    )
    p.add_argument("--epochs", type=int, default=4, help="epochs run at most")
    p.add_argument("--planned-epochs", type=int, default=int(config.get("train.epochs")))
    p.add_argument("--target", type=float, default=0.99)
    p.add_argument("--batch-size", type=int, default=int(config.get("train.batch-size")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--store", default=None)
    p.add_argument("--no-save", action="store_true")
    p.add_argument(
        "--settings",
        default=None,
        help="a JSON file: a list of settings (dicts overriding the flags' values), swept "
        "instead of the flags' product",
    )
    args = p.parse_args(argv)
    store = args.store or mnist_store()
    settings = []
    for R, T, k, lr, w, f in itertools.product(
        _ints(args.replicas),
        _ints(args.threads),
        _ints(args.push_every),
        _floats(args.lr),
        _floats(args.lr_warmup),
        args.factor.split(","),
    ):
        factor = _factor(f, R, T)
        if f == "rule":
            plan = _rule(R, T)
            k, w = plan.push_every, plan.warmup
        settings.append(
            {
                "name": f"R{R}xT{T} k{k} lr{lr} w{w} f{f} s{int(args.staleness)} m{args.server_momentum}/{args.server_lr}",
                "replicas": R,
                "threads": T,
                "push_every": k,
                "lr": lr,
                "lr_warmup": w,
                "factor_rule": f,
                "factor": round(factor, 6),
                "staleness": args.staleness,
                "server_momentum": args.server_momentum,
                "server_lr": args.server_lr,
                "lag": args.lag,
                "epochs": args.epochs,
                "planned_epochs": args.planned_epochs,
                "target": args.target,
                "batch_size": args.batch_size,
                "seed": args.seed,
            }
        )
    if args.settings:
        with open(args.settings) as f:
            extra = json.load(f)
        template = settings[0]
        settings = []
        for over in extra:
            one = {**template, **over}
            one["factor"] = round(
                _factor(str(one["factor_rule"]), one["replicas"], one["threads"]), 6
            )
            if one["factor_rule"] == "rule":
                plan = _rule(one["replicas"], one["threads"])
                one["push_every"], one["lr_warmup"] = plan.push_every, plan.warmup
            one["name"] = " ".join(f"{k}={v}" for k, v in over.items())
            settings.append(one)
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        futs = [ex.submit(run_setting, s, store) for s in settings]
        for fut in futs:
            line = fut.result()
            line.pop("name")
            record("async_sweep", line, save=not args.no_save)


def _rule(replicas: int, threads: int):
    """The defaults' plan (adam_dask.train.streams) for ``replicas`` x ``threads``."""
    from adam_dask import config
    from adam_dask.train.streams import stream_plan

    return stream_plan(
        "async",
        replicas,
        threads,
        push_every=None,
        lr_streams=config.get("train.lr-streams"),
        lr_replicas=config.get("train.lr-replicas"),
        lr_warmup=None,
    )


def _factor(rule: str, replicas: int, threads: int) -> float:
    if rule == "rule":
        return _rule(replicas, threads).rate_factor
    if rule == "inv":
        return 1.0 / replicas
    return float(rule)


if __name__ == "__main__":
    main()
