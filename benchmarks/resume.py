"""Benchmark: resuming mid-epoch after the whole cluster is lost (issue 11).

A cluster is started from the command line (``dask scheduler``, 3 PS workers on distinct
loopback hosts, 1 DATA, ``--trainers`` TRAIN workers). A first run (another process) trains real
MNIST with a file checkpoint; once the checkpoint holds ``--kill-at`` of epoch 1, the scheduler
is SIGKILLed, then every worker and the run. A new cluster is started and the run resumed with
``Trainer.resume`` (what ``adam-dask train --resume`` calls) to finish epoch 1.

The JSON line (appended to ``benchmarks/results/resume.jsonl``): ``first_push_seconds`` (from
the call to ``Trainer.resume`` to the first push the parameter server applied; includes
restoring the server from the checkpoint and starting the data servers),
``images_in_checkpoint`` (epoch 1's images the checkpoint held), ``images_retrained`` (images
the resumed run trained beyond those the checkpoint did not hold: the stretches re-trained for
shards that missed a push), ``images_lost_at_crash`` (images the first run had trained in epoch
1, by its last progress report before the kill, that the checkpoint did not hold: the lost work,
bounded by ``adam.ps.writeback-interval``), ``images_applied`` of the resumed epoch (the split's
size when each image was applied once), its test accuracy, and ``resume_seconds`` (the rest of
the epoch).

Usage: ``python benchmarks/resume.py [--n-train 60000] [--kill-at 0.5] [--trainers 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from _common import mnist_subset_store, record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(trainers: int) -> tuple[str, list[subprocess.Popen]]:
    """(scheduler address, [scheduler, workers...]) started as ``dask`` command lines."""
    from distributed import Client

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1"]
            + ["--port", str(port), "--no-dashboard"],
            **quiet,
        )
    ]
    roles = [("PS=1", "127.0.0.2"), ("PS=1", "127.0.0.3"), ("PS=1", "127.0.0.4")]
    roles += [("DATA=1", "127.0.0.1")] + [("TRAIN=1", "127.0.0.1")] * trainers
    for res, host in roles:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1"]
                + ["--resources", res, "--no-nanny", "--host", host, "--memory-limit", "2GiB"],
                **quiet,
            )
        )
    with Client(address, timeout=60) as c:
        c.wait_for_workers(len(roles), timeout=180)
    return address, procs


def kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


FIRST_RUN = textwrap.dedent(
    """
    import json, sys
    from distributed import Client
    from adam_dask.train.trainer import Trainer

    address, store, ckpt, progress = sys.argv[1:5]

    class T(Trainer):
        def _on_progress(self, event):
            super()._on_progress(event)
            if self.epoch == 1:
                with open(progress, "w") as f:
                    json.dump(sum(self._progress_state.values()), f)

    with Client(address) as client:
        t = T(store, client=client, checkpoint=ckpt, epoch_quorum=1.0, progress=False)
        t.fit(epochs=2)
    """
)


def held_images(ckpt: str, epoch: int) -> tuple[int | None, int]:
    """(the manifest's last finished epoch, images of ``epoch`` the checkpoint holds)."""
    from adam_dask.ps.checkpoint import read_manifest, read_marks
    from adam_dask.train._position import applied_images

    try:
        manifest = read_manifest(ckpt)
        marks = read_marks(ckpt, None, manifest)
    except Exception:
        return None, 0
    per_shard: dict = {}
    for sid, ms in marks.items():
        per: dict = {}
        for m in ms:
            if m.epoch == epoch:
                per.setdefault(m.replica, []).append(m)
        per_shard[sid] = per
    return manifest.get("epoch"), applied_images(per_shard)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-train", type=int, default=60000)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of epoch 1 held")
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    from distributed import Client

    from adam_dask import config
    from adam_dask.train.trainer import Trainer

    store = mnist_subset_store(args.n_train)
    work = tempfile.mkdtemp(prefix="adam-resume-bench-")
    ckpt, progress = os.path.join(work, "ckpt"), os.path.join(work, "progress.json")
    address, procs = start_cluster(args.trainers)
    run = subprocess.Popen(
        [sys.executable, "-c", FIRST_RUN, address, store, ckpt, progress],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            finished, held = held_images(ckpt, 1)
            if finished == 0 and held >= args.kill_at * args.n_train:
                break
            if run.poll() is not None:
                raise SystemExit("the first run ended before it was interrupted")
            time.sleep(0.1)
        try:
            with open(progress) as f:
                drawn = int(json.load(f))
        except (OSError, ValueError):
            drawn = None
        kill(procs[:1])  # the scheduler first
        time.sleep(0.5)
        kill(procs[1:] + [run])
    finally:
        kill(procs + [run])
    _, held = held_images(ckpt, 1)

    address, procs = start_cluster(args.trainers)
    try:
        with Client(address) as client:
            t0 = time.perf_counter()
            trainer = Trainer.resume(ckpt, client=client, progress=False)
            box: dict = {}
            th = threading.Thread(
                target=lambda: box.update(h=trainer.fit(epochs=2)), daemon=True, name="fit"
            )
            base = trainer.server.stats().get("pushes_applied", 0)
            th.start()
            first_push = None
            while th.is_alive() and first_push is None:
                if trainer.server.stats().get("pushes_applied", 0) > base:
                    first_push = time.perf_counter() - t0
                time.sleep(0.05)
            th.join()
            seconds = time.perf_counter() - t0
            last = trainer.history.last
            trainer.close()
    finally:
        kill(procs)
    missing = args.n_train - held
    record(
        "resume",
        {
            "n_train": args.n_train,
            "trainers": args.trainers,
            "kill_at": args.kill_at,
            "writeback_interval": float(config.get("ps.writeback-interval")),
            "first_push_seconds": first_push,
            "resume_seconds": seconds,
            "images_in_checkpoint": held,
            "images_trained_after_resume": last["images"],
            "images_retrained": last["images"] - missing,
            "images_lost_at_crash": None if drawn is None else max(0, drawn - held),
            "images_applied": last["images_applied"],
            "epochs": [r["epoch"] for r in trainer.history.records],
            "test_accuracy": last["test_accuracy"],
            "load_average": os.getloadavg()[0],
        },
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
