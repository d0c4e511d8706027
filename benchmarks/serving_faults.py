"""Benchmark: what a frozen DATA worker costs the stream that reads from it (issue 11).

A consumer task on the TRAIN worker drains two epochs of the real MNIST store through the
DataServers at a steady ``--train-rate`` (sleeps stand in for training). Epoch 0 runs
undisturbed (the baseline); ``--freeze-after`` seconds into epoch 1 this process sends SIGSTOP
to a DATA worker (``adam_dask.testing.freeze``: sockets open, nothing answers). Two scenarios:

* ``moved``: two DATA workers, one frozen: its partition moves to the other;
* ``local``: one DATA worker, frozen: the stream serves the partition itself until the worker
  is thawed (``--thaw-after`` seconds later), then returns to it;
* ``trainer``: ``Trainer.fit(epochs=2)`` on the default cluster, its one DATA worker frozen 8 s
  after the replicas started and left frozen (the measurement of issue 11: 192-205 s per epoch before, ~25 s without
  the freeze), against the same run undisturbed.

One JSON line per scenario (appended to ``benchmarks/results/serving_faults.jsonl``):
``stall_seconds`` (the longest the consumer waited for a batch after the SIGSTOP),
``extra_wait_seconds`` (its waits in the frozen epoch minus the baseline epoch's),
``epoch_seconds`` and ``baseline_epoch_seconds``, and the stream's counts (recoveries,
unanswered probes, call timeouts, batches served locally, returns to a DATA worker).

Usage: ``python benchmarks/serving_faults.py [--scenario moved|local|trainer|all]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

logger = logging.getLogger("benchmarks.serving_faults")


def consume(service, train_rate: float, go: str) -> list[dict]:
    """Two paced epochs (replica 0 of 1); announces epoch 1 through the Event ``go``."""
    from distributed import Event

    out = []
    for epoch in (0, 1):
        stream = service.stream(0, 1, epoch)
        if epoch == 1:
            Event(go).set()
        t0 = time.time()
        waits = []  # (time the batch arrived, seconds next() blocked)
        n = 0
        while True:
            t = time.perf_counter()
            try:
                _, y = next(stream)
            except StopIteration:
                break
            waits.append((time.time(), time.perf_counter() - t))
            n += len(y)
            time.sleep(len(y) / train_rate)
        out.append(
            {"epoch": epoch, "images": n, "t0": t0, "seconds": time.time() - t0, "waits": waits}
            | stream.stats()
        )
    return out


def run(scenario: str, url: str, args: argparse.Namespace) -> dict:
    import adam_dask
    from adam_dask.data import DataService
    from adam_dask.testing import freeze, thaw

    data_nodes = 2 if scenario == "moved" else 1
    with adam_dask.cluster.local(ps_nodes=0, data_nodes=data_nodes, trainers=1) as client:
        from distributed import Event

        service = DataService.create(client, url, augment=True, batch_size=args.batch_size)
        pids: dict[str, int] = {}
        thawed: list[float] = []
        try:
            go = f"serving-faults-{scenario}"
            task = client.submit(
                consume, service, args.train_rate, go, resources={"TRAIN": 1}, pure=False
            )
            Event(go, client=client).wait()
            time.sleep(args.freeze_after)
            victim = service.servers()[0]
            t_stop = time.time()
            pids = freeze(client, [victim])
            timer = None
            if scenario == "local":

                def later() -> None:
                    thaw(pids)
                    thawed.append(time.time())

                timer = threading.Timer(args.thaw_after, later)
                timer.start()
            base, hit = task.result()
            if timer is not None:
                timer.join()
                pids = {}
        finally:
            thaw(pids)
            service.close()
    after = [w for t, w in hit["waits"] if t >= t_stop]
    return {
        "scenario": scenario,
        "data_nodes": data_nodes,
        "batch_size": args.batch_size,
        "train_rate_images_per_s": args.train_rate,
        "freeze_after_seconds": args.freeze_after,
        "thaw_after_seconds": args.thaw_after if scenario == "local" else None,
        "stall_seconds": max(after, default=0.0),
        "extra_wait_seconds": hit["wait_seconds"] - base["wait_seconds"],
        "epoch_seconds": hit["seconds"],
        "baseline_epoch_seconds": base["seconds"],
        "images": hit["images"],
        "recoveries": hit["recoveries"],
        "unanswered": hit["unanswered"],
        "call_timeouts": hit["call_timeouts"],
        "local_batches": hit["local_batches"],
        "batches": hit["batches"],
        "returns": hit["returns"],
    }


def _freeze_when_training(
    client, addrs: list[str], after: float, pids: dict[str, int], stop: threading.Event
) -> None:
    """SIGSTOP ``addrs`` ``after`` seconds after the first replica reported progress."""
    from _common import wait_for_training

    from adam_dask.testing import freeze

    wait_for_training(client, stop)
    if not stop.wait(after):
        pids.update(freeze(client, addrs))


def run_trainer(url: str, args: argparse.Namespace) -> dict:
    """The issue's measurement: ``Trainer.fit(epochs=2)`` on the default embedded cluster (one
    DATA worker), once undisturbed and once with the DATA worker frozen ``--trainer-freeze-after``
    seconds after the replicas started (and never thawed: they serve the data themselves)."""
    import adam_dask
    from adam_dask.cluster import DATA, workers_with_role
    from adam_dask.testing import thaw

    seconds: dict[str, list[float]] = {}
    applied: dict[str, list] = {}
    stall: dict[str, list] = {}  # per epoch, the largest share of time a replica waited for data
    for case in ("baseline", "frozen"):
        with adam_dask.cluster.local() as client:
            pids: dict[str, int] = {}
            stop = threading.Event()
            if case == "frozen":
                victims = workers_with_role(client, DATA)
                threading.Thread(
                    target=_freeze_when_training,
                    args=(client, victims, args.trainer_freeze_after, pids, stop),
                    daemon=True,
                ).start()
            try:
                with adam_dask.Trainer(url, client=client, progress=False) as trainer:
                    history = trainer.fit(epochs=2)
            finally:
                stop.set()
                thaw(pids)
        seconds[case] = [float(r["seconds"]) for r in history]
        stall[case] = [r.get("stall_fraction") for r in history]
        applied[case] = [r.get("images_applied") for r in history]
    return {
        "scenario": "trainer",
        "data_nodes": 1,
        "freeze_after_seconds": args.trainer_freeze_after,
        "epoch_seconds": seconds["frozen"],
        "baseline_epoch_seconds": seconds["baseline"],
        "extra_seconds": sum(seconds["frozen"]) - sum(seconds["baseline"]),
        "stall_fraction": stall["frozen"],
        "baseline_stall_fraction": stall["baseline"],
        "images_applied": applied["frozen"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=["moved", "local", "trainer", "all"], default="all")
    p.add_argument(
        "--trainer-freeze-after",
        type=float,
        default=8.0,
        help="seconds after the replicas' first progress report",
    )
    p.add_argument("--batch-size", type=int, default=64, help="the trainer's stream batch")
    p.add_argument("--train-rate", type=float, default=5000.0, help="images/s of the consumer")
    p.add_argument("--freeze-after", type=float, default=3.0, help="seconds into epoch 1")
    p.add_argument("--thaw-after", type=float, default=6.0, help="seconds after the SIGSTOP")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from _common import mnist_store, record

    url = mnist_store()
    for scenario in ("moved", "local", "trainer") if args.scenario == "all" else (args.scenario,):
        result = run_trainer(url, args) if scenario == "trainer" else run(scenario, url, args)
        result["load_average"] = os.getloadavg()[0]  # the machine is shared: how busy it was
        record("serving_faults", result, save=not args.no_save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
