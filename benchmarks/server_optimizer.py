"""Benchmark: the parameter server's optimizer (issue 41): test accuracy after a run of
`adam-dask train` on real MNIST with each server optimizer and push interval, several seeds.

For each setting ``OPTIMIZER@K`` (``sum@512``, ``nesterov+staleness@4096``, ...) the real CLI
trains on the embedded cluster (``--trainers R --threads 1``, the default recipe otherwise) for
``--epochs`` epochs, once per seed, and the test accuracy after the last epoch is kept. One JSON
line per setting goes to benchmarks/results/server_optimizer.jsonl: ``optimizer``,
``push_every``, ``replicas``, ``epochs``, ``seeds``, ``accuracies`` (one per seed, in order),
``curves`` (each seed's test accuracy after every epoch), ``mean_accuracy``, ``server_lr`` and
``server_momentum`` (nesterov), ``wall_seconds`` (per seed) and ``bytes_pushed_per_image``: what
a replica sends per image it trains, ``4 x parameters / push_every`` (each push carries the
whole model's delta). The communication goal (issue 41): the best optimizer at push every 4096
reaches at least the mean accuracy of ``sum`` at 512, with 8x fewer bytes per image.

With ``--target 0.99`` each run stops at the first epoch at or above it (the CLI's
``--target-accuracy``) and the line adds ``seconds_to_target`` and ``epochs_to_target`` per seed
(None where the run never reached it): time to 99% at the defaults is ``--replicas 1
--threads 0`` (``0``: the TRAIN worker's threads, ``adam.cluster.trainer-threads: auto``).

With ``--link-rate 20mbit`` each run has a namespace cluster of its own instead
(``adam_dask.testing.NetnsCluster``: a scheduler, 3 PS, 1 DATA and ``--replicas`` TRAIN hosts,
each its own network stack; root), and the links of the PS hosts are held to that rate both ways
(a ``tc`` token bucket): every push, pull and backup's copy crosses them, the images do not (the
data servers stand beside the replicas, as in the paper). The CLI joins it with ``--scheduler``.
The line adds ``cluster: "netns"``, ``link_rate`` and ``links_shaped``; its ``load`` is the
load average before the setting's first run (after waiting up to 150 s for it to fall below 2:
other work), and ``own_load_after`` the one after its last (the cluster's own processes). Where bandwidth is scarce
(issue 41): time to 99% with the best setting at 4096 <= 0.5x ``sum`` at 512, 2 replicas.

    python benchmarks/server_optimizer.py --settings sum@512 nesterov+staleness@4096 \
        [--seeds 0 1 2 3 4] [--replicas 4] [--threads 1] [--epochs 10] [--target A] [--no-save]
        [--link-rate 20mbit]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

from _common import mnist_store, record, train_cli


def parameters() -> int:
    """The default network's parameter count (what every push's delta holds)."""
    from adam_dask.model.network import Network

    return int(Network.from_spec().flat.shape[0])


PS_NODES = 3  # the paper's three copies of every shard, each on a PS host of its own


@contextlib.contextmanager
def slow_cluster(replicas: int, rate: str):
    """A namespace cluster (3 PS, 1 DATA, ``replicas`` TRAIN hosts of one thread) whose PS hosts'
    links run at ``rate``; yields its scheduler's address."""
    from adam_dask.testing import NetnsCluster

    with NetnsCluster(ps_nodes=PS_NODES, data_nodes=1, trainers=replicas) as net:
        for i in range(PS_NODES):
            net.shape(f"ps-{i}", rate=rate)
        yield net.scheduler_address


def settle(below: float = 2.0, most: float = 150.0) -> None:
    """Wait (at most ``most`` seconds) for the 1-minute load average to fall below ``below``, so
    the load recorded before a setting is other work's, not the previous setting's cluster."""
    import time

    end = time.monotonic() + most
    while os.getloadavg()[0] >= below and time.monotonic() < end:
        time.sleep(5)


def run_once(
    store: str,
    optimizer: str,
    push_every: int,
    replicas: int,
    epochs: int,
    seed: int,
    threads: int = 1,
    target: float | None = None,
    link_rate: str | None = None,
):
    """(test accuracy after every epoch, wall seconds, the CLI's result) of one CLI run: on the
    embedded cluster, or with ``link_rate`` on a namespace cluster of its own whose PS links are
    held to that rate."""
    flags = ["--epochs", str(epochs), "--seed", str(seed)]
    flags += ["--push-every", str(push_every), "--server-optimizer", optimizer, "--no-checkpoint"]
    if threads > 0:
        flags += ["--threads", str(threads)]
    if target is not None:
        flags += ["--target-accuracy", str(target)]
    with contextlib.ExitStack() as stack:
        if link_rate is None:
            flags += ["--trainers", str(replicas)]
        else:
            flags += ["--scheduler", stack.enter_context(slow_cluster(replicas, link_rate))]
        history, result, wall = train_cli(store, *flags)
    return [round(float(r["test_accuracy"]), 4) for r in history], round(wall, 1), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", nargs="+", required=True, metavar="OPTIMIZER@K")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="per replica; 0: the default (auto)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument(
        "--link-rate",
        default=None,
        metavar="RATE",
        help="a namespace cluster per run, its PS hosts' links at RATE (e.g. 20mbit; root)",
    )
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    from adam_dask import config
    from adam_dask.ps.protocol.optimizer import ServerOptimizer
    from adam_dask.train.streams import resolve_push_every

    store = mnist_store()
    n = parameters()
    for setting in args.settings:
        name, _, k = setting.partition("@")
        opt = ServerOptimizer.resolve(name)
        push_every = resolve_push_every(k or config.get("train.push-every"), args.replicas)
        if args.link_rate is not None:
            settle()
        load_before = os.getloadavg()[0]
        curves, walls, to_target, epochs_to = [], [], [], []
        for seed in args.seeds:
            curve, wall, res = run_once(
                store,
                opt.name,
                push_every,
                args.replicas,
                args.epochs,
                seed,
                args.threads,
                args.target,
                args.link_rate,
            )
            curves.append(curve)
            walls.append(wall)
            to_target.append(res.get("seconds_to_target"))
            epochs_to.append(len(curve) if res.get("seconds_to_target") is not None else None)
            print(f"{setting} seed {seed}: {curve[-1]:.4f} ({wall:.0f} s) {curve}", flush=True)
        accs = [c[-1] for c in curves]
        record(
            "server_optimizer",
            {
                "optimizer": opt.name,
                "server_lr": opt.lr,
                "server_momentum": opt.momentum,
                "push_every": push_every,
                "replicas": args.replicas,
                "threads": args.threads or "auto",
                "epochs": args.epochs,
                "seeds": args.seeds,
                "accuracies": accs,
                "mean_accuracy": round(statistics.fmean(accs), 5),
                "curves": curves,
                "wall_seconds": walls,
                "parameters": n,
                "bytes_pushed_per_image": round(4 * n / push_every, 2),
                "lr": config.get("train.lr"),
                "lr_replicas": config.get("train.lr-replicas"),
                "lr_schedule": config.get("train.lr-schedule"),
                **(
                    {"load": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
                    if args.link_rate is None
                    else {
                        # seven processes of its own on this machine: the load after is theirs
                        "load": [round(load_before, 2)],
                        "own_load_after": round(os.getloadavg()[0], 2),
                        "cluster": "netns",
                        "link_rate": args.link_rate,
                        "links_shaped": "ps",
                    }
                ),
                **(
                    {}
                    if args.target is None
                    else {
                        "target": args.target,
                        "seconds_to_target": to_target,
                        "epochs_to_target": epochs_to,
                    }
                ),
            },
            save=not args.no_save,
        )


if __name__ == "__main__":
    main()
