"""Benchmark: what an eviction costs an epoch, for each role (issue 48).

For each role of ``--roles`` (PS, DATA, TRAIN) the embedded cluster (``adam_dask.cluster.local``,
sized from this machine) starts with one worker of that role fewer, and that worker runs as a
``dask worker`` process of its own (``adam_dask.testing.role_worker``, as a pod runs one; a PS
one on a loopback host of its own, so copies stay on distinct hosts). ``Trainer.fit`` trains real
MNIST with a file checkpoint at default settings; at ``--at`` of epoch ``--epoch`` this process
sends that worker SIGTERM, as the kubelet does when it evicts a pod, and once the process has
exited a replacement joins, as the operator starts one.

One JSON line per role (appended to ``benchmarks/results/evictions.jsonl``): ``role``,
``epoch_seconds``, ``fault_epoch``, ``undisturbed_seconds`` (the median of the epochs before the
fault's, the first left out: it warms up), ``ratio`` (the fault's epoch over it; the issue's goal
is at most 1.3), ``next_ratio`` (the epoch after: the replacement's first), ``gone_seconds``
(from SIGTERM to the process's exit), ``replicas`` and ``threads`` per epoch, ``images``,
``images_applied`` and ``images_retrained`` per epoch, ``every_image_once``, ``completed``
and ``error``.

``--containers``: the same evictions on the DaskJob's pods (podman containers as
deploy/operator/job.yaml starts them; ``benchmarks/_pod_evictions.py``), one run evicting each
role in an epoch of its own after ``--epoch`` undisturbed ones, ``--gap`` undisturbed epochs
apart (default 1: each fault's epoch carries its own eviction, the next one the replacement's
settling, ``next_ratio``); the lines say
``cluster: "containers"`` (the processes' say ``"processes"``).

Usage: ``python benchmarks/evictions.py [--roles PS,DATA,TRAIN] [--epochs 5] [--epoch 3]
[--at 0.3] [--n-train N] [--seed 0] [--containers [--gap 1]]``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import mnist_store, mnist_subset_store, record

logger = logging.getLogger("evictions")

ROLES = ("PS", "DATA", "TRAIN")
HOSTS = {"PS": ("127.0.0.9", "127.0.0.10")}  # the evicted PS worker's host, its replacement's


def _joined(client, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(
        w.get("name") == name for w in client.scheduler_info(n_workers=-1)["workers"].values()
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker {name} did not join within {timeout:.0f} s")
        time.sleep(0.2)


def _wait_for_progress(trainer, box: dict, epoch: int, images: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "error" in box or "history" in box:
            raise RuntimeError(f"the fit ended before epoch {epoch} reached {images} images")
        if trainer.epoch == epoch and sum(trainer._progress_state.values()) >= images:
            return
        time.sleep(0.02)
    raise TimeoutError(f"epoch {epoch} did not reach {images} images in {timeout:.0f} s")


def run_role(url: str, role: str, args: argparse.Namespace) -> dict:
    import adam_dask
    from adam_dask.cluster import _role_counts
    from adam_dask.testing import fit_in_background, role_worker

    ps, data, train, threads = _role_counts()
    counts = {"PS": ps, "DATA": data, "TRAIN": train}
    counts[role] -= 1
    evicted, replacement = HOSTS.get(role, ("127.0.0.1", "127.0.0.1"))
    nthreads = threads if role == "TRAIN" else 2
    procs = []
    sent: dict = {}
    split: dict = {}  # the training split's size, once the trainer opened it
    with (
        tempfile.TemporaryDirectory(prefix="adam-evict-") as tmp,
        adam_dask.cluster.local(
            ps_nodes=counts["PS"],
            data_nodes=counts["DATA"],
            trainers=counts["TRAIN"],
            trainer_threads=threads,
        ) as client,
    ):
        sched = client.scheduler.address
        try:
            name = f"{role.lower()}-evicted"
            procs.append(role_worker(sched, role, name=name, host=evicted, nthreads=nthreads))
            _joined(client, name)
            trainer = adam_dask.Trainer(
                url, client=client, checkpoint=f"{tmp}/ckpt", progress=False, seed=args.seed
            )
            th, box = fit_in_background(trainer, epochs=args.epochs)
            try:
                n = len(trainer.train_split) if trainer.train_split is not None else args.n_train
                split["images"] = n
                _wait_for_progress(trainer, box, args.epoch, int(args.at * n))
                t0 = time.monotonic()
                procs[0].send_signal(signal.SIGTERM)  # from outside, as the kubelet sends it
                procs[0].wait(timeout=120)
                sent = {"gone_seconds": time.monotonic() - t0, "exit": procs[0].returncode}
                procs.append(
                    role_worker(
                        sched, role, name=f"{role.lower()}-new", host=replacement, nthreads=nthreads
                    )
                )
            finally:
                th.join()
                trainer.close()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=60)
    records = list(box["history"].records) if "history" in box else []
    n = split.get("images")
    seconds = [r["seconds"] for r in records]
    before = seconds[1 : args.epoch] or seconds[: args.epoch]
    undisturbed = statistics.median(before) if before else None

    def ratio(i: int) -> float | None:
        return seconds[i] / undisturbed if undisturbed and i < len(seconds) else None

    applied = [r["images_applied"] for r in records]
    images = [r["images"] for r in records]
    return {
        "role": role,
        "cluster": "processes",
        "signal": "SIGTERM",
        "at": args.at,
        "fault_epoch": args.epoch,
        "completed": "history" in box and "error" not in box,
        "error": repr(box["error"]) if "error" in box else None,
        "epoch_seconds": seconds,
        "undisturbed_seconds": undisturbed,
        "ratio": ratio(args.epoch),
        "next_ratio": ratio(args.epoch + 1),
        **sent,
        "replicas": [r["replicas"] for r in records],
        "threads": [r.get("threads") for r in records],
        "images": images,
        "images_applied": applied,
        "images_retrained": [r["images_retrained"] for r in records],
        # an evicted TRAIN worker's replica returns no result (its images are not in the
        # epoch's "images"), but its acknowledged pushes are applied: every image once is the
        # whole split applied in every epoch, none re-trained
        "train_images": n,
        "every_image_once": bool(records) and n is not None and all(a == n for a in applied),
        "test_accuracy": [r.get("test_accuracy") for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--roles", default=",".join(ROLES))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--epoch", type=int, default=3, help="the epoch the eviction lands in")
    p.add_argument("--at", type=float, default=0.3, help="how far into that epoch")
    p.add_argument("--n-train", type=int, default=None, help="a subset of MNIST's training set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--containers", action="store_true", help="on the DaskJob's pods (podman)")
    p.add_argument(
        "--gap",
        type=int,
        default=1,
        help="--containers: undisturbed epochs between two roles' evictions (1)",
    )
    args = p.parse_args(argv)
    roles = [r.strip().upper() for r in args.roles.split(",") if r.strip()]
    bad = sorted(set(roles) - set(ROLES))
    if bad:
        p.error(f"unknown roles {bad}; choose from {', '.join(ROLES)}")
    if not 1 <= args.epoch < args.epochs:
        p.error(f"--epoch must be in [1, --epochs): {args.epoch} of {args.epochs}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    url = mnist_subset_store(args.n_train) if args.n_train else mnist_store()
    failed = 0
    if args.containers:
        import _pod_evictions

        for line in _pod_evictions.run(url, roles, args):
            line = record("evictions", line)
            failed += not (line["completed"] and line["every_image_once"])
        return 1 if failed else 0
    for role in roles:
        line = record("evictions", {"epochs": args.epochs, **run_role(url, role, args)})
        failed += not (line["completed"] and line["every_image_once"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
