"""Data-server capacity with emulated replicas: what ONE DATA worker (one DataServer) serves to
N replicas, against a socket sink in the same run. One JSON line, appended to
benchmarks/results/data_capacity.jsonl.

A replica does not train here: it reads its share of each epoch from
``DataService.stream(replica, replicas, epoch)`` as a training replica's task does
(adam_dask/train/task.py: ``data.stream(...)``, a :class:`BatchStream` that keeps
``adam.serving.prefetch`` requests in flight and converts each uint8 batch to float32), one
epoch after another, a new stream each. The batch is the replica's stream batch
(``RunSettings.stream_batch`` for the paced replicas' threads: 64 images for 2 threads), the
augmentation ``adam.augment.enabled`` (off by default: the stored uint8 travel). The store is
real MNIST (60000 training images, ``_common.mnist_store``).

The replicas are threads in the ``--trainers`` TRAIN workers' processes (a seceded Dask task per
worker per step), each with its own stream; there is ONE DATA worker (``adam.serving.threads``
producers, the image plane: Unix sockets and memfd slots on one machine). Two kinds of step:

* drain: every replica reads as fast as one thread can (no training), for the most the DATA
  worker serves to N replicas. Against it, the sink (the machine's limit for the same traffic):
  a plain thread-per-connection server on a Unix socket in the DATA worker's process that
  answers each one-byte request with the bytes a batch carries (the images, labels and
  indices, from one preallocated buffer: no gather, no bookkeeping, where ours names a shared
  slot instead of sending the images); its readers keep as many requests in flight and convert
  the images to float32 as a stream does. The steps of ours and of the sink alternate at each
  N, so both see the same machine.
* paced: a replica is ``--threads`` threads (``adam.cluster.trainer-threads`` as sized for this
  machine) taking batches from its one stream under a lock, as a replica's Hogwild threads
  take them (adam_dask/train/replica.py), each consuming ``--thread-rate`` images/s (the newest
  ``images_per_s_1thread`` of benchmarks/results/engine.jsonl: one engine thread here) by
  sleeping where it would train, so the DATA worker has the cores the replicas would use. N
  grows until the worst replica's stall (its time in ``next`` / the window, as
  :meth:`BatchStream.stats` counts it) passes 0.1.

Every step runs ``--warmup`` seconds unmeasured, then ``--seconds`` measured.

Keys:

* ``curve`` / ``sink_curve`` (drain) and ``paced_curve``, one dict per N:

  - ``replicas``; ``images_per_s`` (images delivered in the window, all replicas) and
    ``images_per_s_each`` (min / max over replicas);
  - ``batch_ms_p50`` / ``batch_ms_p99``: per-batch latency, the time a replica blocked in
    ``next`` for a batch (with prefetch a batch can be ready: then near 0);
  - ``stall`` / ``stall_max``: the replicas' mean and worst fraction of the window blocked;
  - ``data_cores``: CPU seconds per second (psutil, user + system) of the DATA worker's process
    (for the sink: the sink's threads, in that process); ``reader_cores``: of the TRAIN
    processes; ``client_cores``: this process (the scheduler's); ``machine_cores_busy``,
    ``other_cores`` (the machine's busy cores outside these processes: another job);
    ``data_cpu_us_per_image``: the DATA worker's CPU per image served;
  - paced only: ``threads`` (N x threads), ``offered_images_per_s`` (threads x
    ``thread_rate``: a replica that never waited would take a little less, its sleeps
    overshoot) and ``within`` (the worst replica's stall at most ``stall_bound``, no error).
* ``served_vs_sink``: at each N, ours' drain images/s over the sink's (``ratio_by_replicas``),
  and ``served_vs_sink`` at the largest N both ran;
* ``images_per_s_max``: the most ours served in a drain step (any N), ``sink_images_per_s_max``;
* ``images_per_s_at_stall``: the images/s delivered in the paced step with the most replicas
  within the stall bound (the capacity ``adam.cluster.data-nodes: auto`` is sized from,
  adam_dask/sizing.py), ``replicas_at_stall`` / ``threads_at_stall``: its N and threads;
  ``threads_per_data_worker``: ``images_per_s_at_stall // thread_rate``, engine threads one
  DATA worker keeps fed; ``past_at``: the first N past the bound (null: none was, up to
  ``--max``, and the figures are floors);
* ``data_rss_mb`` / ``data_rss_mb_after``: the DATA worker's resident memory before the steps
  (its partition loaded) and after them; ``data_idle_cores``: its cores over 2 s serving
  nothing: with ``data_cpu_us_per_image``, what a DATA worker costs;
* ``batch_images``, ``prefetch``, ``buffer_batches``, ``producer_threads``, ``augment``,
  ``data_plane``, ``trainers``, ``thread_rate`` (and ``thread_rate_from``),
  ``replica_threads``, ``stall_bound``,
  ``seconds``, ``warmup``; ``load_before`` / ``load_after`` (1-minute load average), the 2-core
  machine's figures being shared with other work when high.

Usage: python benchmarks/data_capacity.py [--counts 1,2,4,8,16] [--max 32] [--seconds 4]
       [--warmup 1] [--trainers 2] [--thread-rate IPS] [--threads T] [--only drain|paced]
       [--wait-quiet S] [--no-save]
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import numpy as np
from _sink import SocketSink, stop_sink
from _step import ms, replica_threads, run_step

logger = logging.getLogger("data_capacity")

DRAIN_COUNTS = (1, 2, 4, 8, 16)
PACED_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
STALL_BOUND = 0.1
SINK = "_data_capacity_sink"  # the sink's attribute on the DATA worker that runs it


# -- the readers: threads inside a task on a TRAIN worker -----------------------------------------


class _SinkStream:
    """One replica's connection to the sink: ``prefetch`` one-byte requests in flight, each
    answered with one batch's bytes, converted to float32 as a stream converts them."""

    def __init__(self, address: str, layout: tuple[int, int, int], prefetch: int):
        from adam_dask.data.augment import as_model_input

        self.convert = as_model_input
        self.batch, self.h, self.w = layout
        self.nbytes = self.batch * self.h * self.w + 16 * self.batch  # images, y and idx
        self.buf = np.empty(self.nbytes, np.uint8)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect("\0" + address)
        for _ in range(prefetch):
            self.sock.sendall(b"n")

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        mv = memoryview(self.buf)
        got = 0
        while got < self.nbytes:
            k = self.sock.recv_into(mv[got:], self.nbytes - got)
            if k == 0:
                raise ConnectionError("the sink closed the connection")
            got += k
        self.sock.sendall(b"n")
        n = self.batch * self.h * self.w
        x = self.convert(self.buf[:n].reshape(self.batch, self.h, self.w, 1))
        y = self.buf[n : n + 8 * self.batch].view(np.int64).copy()
        return x, y

    def close(self) -> None:
        self.sock.close()


def _replica(
    target: tuple[str, Any],
    g: int,
    replicas: int,
    pace: tuple[float, int] | None,
    window: tuple[float, float, float],
    out: dict,
) -> None:
    """One emulated replica: its stream (epoch after epoch of its share) read until ``end``.
    Drained by one thread when ``pace`` is None; else ``pace = (rate, threads)``: ``threads``
    threads take batches from the one stream under a lock, as a replica's Hogwild threads do,
    and each consumes ``rate`` images/s (it sleeps where it would train). Latencies (the time
    in ``next``, under the lock, as :meth:`BatchStream.stats` counts a replica's wait) of the
    batches that arrive inside ``[measure, end)``."""
    start, measure, end = window
    kind, what = target
    rate, threads = pace if pace is not None else (0.0, 1)
    lock = threading.Lock()
    state: dict[str, Any] = {"stream": None, "epoch": 0, "lat": [], "waited": 0.0, "images": 0}
    errors: list[str] = []

    def take() -> int:
        while True:
            if state["stream"] is None:
                if kind == "ours":
                    state["stream"] = iter(what[0].stream(g, replicas, state["epoch"]))
                else:
                    state["stream"] = _SinkStream(*what)
                state["epoch"] += 1
            t0 = time.perf_counter()
            try:
                _, y = next(state["stream"])
            except StopIteration:
                state["stream"] = None
                continue
            t1 = time.perf_counter()
            now = time.time()
            if measure <= now < end:
                state["lat"].append((t1 - t0) * 1e3)
                state["waited"] += min(t1 - t0, now - measure)
                state["images"] += len(y)
            return len(y)

    def work() -> None:
        try:
            while time.time() < end and not errors:
                with lock:
                    n = take()
                if rate:  # where a replica's thread trains on the batch
                    time.sleep(n / rate)
        except Exception as exc:
            errors.append(repr(exc))

    time.sleep(max(0.0, start - time.time()))
    workers = [
        threading.Thread(target=contextvars.copy_context().run, args=(work,), daemon=True)
        for _ in range(threads)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if state["stream"] is not None:
        state["stream"].close()
    out.update(
        lat=state["lat"],
        waited=state["waited"],
        images=state["images"],
        error=errors[0] if errors else None,
    )


def run_replicas(
    indices: list[int],
    replicas: int,
    window: tuple[float, float, float],
    target: tuple[str, Any],
    pace: tuple[float, int] | None,
) -> list[dict]:
    """A Dask task: one emulated replica (:func:`_replica`) per index in ``indices`` (of
    ``replicas``), each in threads of its own; returns their results."""

    def replica(g: int, out: dict) -> None:
        # the stream finds the worker through the task's context, which the thread runs in
        _replica(target, g, replicas, pace, window, out)

    return replica_threads(indices, replica, "replica")


# -- the sink: a Unix-socket server in the DATA worker's process ----------------------------------


class Sink(SocketSink):
    """Answers each one-byte request with ``nbytes`` from one preallocated buffer, a thread per
    connection (a Unix socket in the abstract namespace, ``name``)."""

    def __init__(self, nbytes: int):
        import secrets

        self.payload = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, np.uint8))
        self.name = f"adam-data-capacity-sink-{os.getpid()}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self.name)
        listener.listen(1024)
        super().__init__(listener, "data-capacity-sink")

    def serve(self, conn: socket.socket) -> None:
        while True:
            if not conn.recv(1):
                return
            conn.sendall(self.payload)


def start_sink(dask_worker: Any, nbytes: int) -> str:
    sink = Sink(nbytes)
    setattr(dask_worker, SINK, sink)
    return sink.name


def prime(service: Any) -> int:
    """One stream's first batches from this process (the plane's endpoint learnt, kernels
    compiled)."""
    stream = service.stream(0, 1, 10_000)
    n = 0
    for _, y in stream:
        n += len(y)
        if n >= 1024:
            break
    stream.close()
    return n


# -- one step: N replicas against one target ------------------------------------------------------


def step(
    client: Any,
    trainers: list[str],
    target: tuple[str, Any],
    replicas: int,
    pace: tuple[float, int] | None,
    seconds: float,
    warmup: float,
    pids: dict[str, list[int]],
) -> dict:
    """``replicas`` emulated replicas against ``target`` for ``warmup + seconds``; the step's
    dict of a curve (see the module's docstring)."""
    res = run_step(
        client,
        trainers,
        run_replicas,
        (target, pace),
        replicas,
        timing=(0.01, warmup, seconds),
        pids=pids,
        log=logger,
        noun="replicas",
    )
    outs, errors = res.outs, res.errors
    lat = np.array([x for o in outs for x in o["lat"]], np.float64)
    each = [o["images"] / seconds for o in outs]
    stalls = [o["waited"] / seconds for o in outs]
    images = sum(o["images"] for o in outs)

    def pct(q: float) -> float | None:
        return float(np.percentile(lat, q)) if lat.size else None

    machine = res.machine()
    row: dict[str, Any] = {
        "replicas": replicas,
        "images_per_s": images / seconds,
        "images_per_s_each": [min(each, default=0.0), max(each, default=0.0)],
        "batch_ms_p50": pct(50),
        "batch_ms_p99": pct(99),
        "stall": float(np.mean(stalls)) if stalls else 1.0,
        "stall_max": max(stalls, default=1.0),
        "data_cores": res.cores("data"),
        "reader_cores": res.cores("train"),
        "client_cores": res.cores("client"),
        "machine_cores_busy": machine["machine_cores_busy"],
        "other_cores": machine["other_cores"],
        "data_cpu_us_per_image": sum(res.used["data"]) / images * 1e6 if images else None,
        "load": os.getloadavg()[0],
    }
    if pace is not None:
        row["threads"] = replicas * pace[1]
        row["offered_images_per_s"] = replicas * pace[1] * pace[0]
        row["within"] = bool(not errors and row["stall_max"] <= STALL_BOUND)
    if errors:
        row["errors"] = sorted(set(errors))[:3]
    logger.info(
        "%s%s %2d replicas: %.0f images/s (each %.0f-%.0f), batch p50/p99 %s/%s ms, stall "
        "%.2f (max %.2f), DATA %.2f cores, readers %.2f, machine %.2f busy (other %.2f)%s",
        target[0],
        " paced" if pace else "",
        replicas,
        row["images_per_s"],
        *row["images_per_s_each"],
        ms(row["batch_ms_p50"], 2),
        ms(row["batch_ms_p99"], 2),
        row["stall"],
        row["stall_max"],
        row["data_cores"],
        row["reader_cores"],
        row["machine_cores_busy"],
        row["other_cores"],
        "" if row.get("within", True) else "  -> past the bound",
    )
    return row


def data_idle(pid: int, seconds: float = 2.0) -> dict:
    """What the DATA worker costs serving nothing: its resident memory (the partition in its
    cache included) and its cores over ``seconds`` (the worker's own event loop, heartbeats)."""
    import psutil

    proc = psutil.Process(pid)
    t0 = proc.cpu_times()
    time.sleep(seconds)
    t1 = proc.cpu_times()
    return {
        "data_rss_mb": proc.memory_info().rss / 2**20,
        "data_idle_cores": (t1.user + t1.system - t0.user - t0.system) / seconds,
    }


# -- the run --------------------------------------------------------------------------------------


def bench(args: argparse.Namespace, pace: tuple[float, int]) -> dict:
    import psutil
    from _common import mnist_store

    import adam_dask
    from adam_dask import config
    from adam_dask.cluster import DATA, TRAIN, workers_with_role
    from adam_dask.data.serving import DataService
    from adam_dask.testing import worker_pids
    from adam_dask.train._settings import RunSettings

    store = mnist_store()
    batch = RunSettings.resolve().stream_batch(pace[1])
    curve: list[dict] = []
    sink_curve: list[dict] = []
    paced: list[dict] = []
    with adam_dask.cluster.local(
        ps_nodes=0, data_nodes=1, trainers=args.trainers, trainer_threads=1
    ) as client:
        data = workers_with_role(client, DATA)
        trainers = workers_with_role(client, TRAIN)
        pids = {
            "data": list(worker_pids(client, data).values()),
            "train": list(worker_pids(client, trainers).values()),
        }
        logger.info("DATA worker pid %s, TRAIN %s", pids["data"], pids["train"])
        svc = DataService.create(client, store, batch_size=batch, seed=0)
        shape = svc.input_shape  # (C, H, W)
        sink = client.run(start_sink, nbytes=batch * (shape[1] * shape[2] + 16), workers=data)
        prefetch = int(config.get("serving.prefetch"))
        targets = {
            "ours": ("ours", (svc,)),
            "sink": ("sink", (sink[data[0]], (batch, shape[1], shape[2]), prefetch)),
        }
        info = {
            "batch_images": batch,
            "images": len(svc),
            "prefetch": prefetch,
            "buffer_batches": svc.settings.buffer_batches,
            "producer_threads": svc.settings.threads,
            "augment": svc.augment is not None,
            "data_plane": str(config.get("serving.data-plane")),
            "trainers": len(trainers),
        }

        def run(target: tuple[str, Any], n: int, pace_: tuple[float, int] | None) -> dict:
            return step(client, trainers, target, n, pace_, args.seconds, args.warmup, pids)

        try:
            client.gather([client.submit(prime, svc, workers=[a], pure=False) for a in trainers])
            info.update(data_idle(pids["data"][0]))
            if args.only in (None, "drain"):
                for n in args.drain_counts:
                    for kind, rows in (("ours", curve), ("sink", sink_curve)):
                        rows.append(run(targets[kind], n, None))
            if args.only in (None, "paced"):
                for n in args.paced_counts:
                    row = run(targets["ours"], n, pace)
                    paced.append(row)
                    if not row["within"]:
                        break
            info["data_rss_mb_after"] = psutil.Process(pids["data"][0]).memory_info().rss / 2**20
        finally:
            client.run(stop_sink, attr=SINK, workers=data)
            svc.close()
    ratios = {
        str(a["replicas"]): a["images_per_s"] / b["images_per_s"]
        for a, b in zip(curve, sink_curve, strict=True)
        if b["images_per_s"]
    }
    within = [r for r in paced if r["within"]]
    past = next((r["replicas"] for r in paced if not r["within"]), None)
    at_stall = within[-1]["images_per_s"] if within else 0.0
    return {
        "images_per_s_max": max((r["images_per_s"] for r in curve), default=None),
        "sink_images_per_s_max": max((r["images_per_s"] for r in sink_curve), default=None),
        "served_vs_sink": list(ratios.values())[-1] if ratios else None,
        "ratio_by_replicas": ratios,
        "images_per_s_at_stall": at_stall,
        "replicas_at_stall": within[-1]["replicas"] if within else 0,
        "threads_at_stall": within[-1]["threads"] if within else 0,
        "threads_per_data_worker": int(at_stall // pace[0]),
        "past_at": past,
        **info,
        "thread_rate": pace[0],
        "replica_threads": pace[1],
        "stall_bound": STALL_BOUND,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "curve": curve,
        "sink_curve": sink_curve,
        "paced_curve": paced,
    }


def _counts(text: str) -> list[int]:
    return sorted({int(c) for c in text.split(",") if c.strip()})


def main() -> None:
    from _common import engine_rate, record

    from adam_dask import config, sizing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default=",".join(map(str, DRAIN_COUNTS)), help="drain steps' N")
    p.add_argument(
        "--max", type=int, default=PACED_COUNTS[-1], help="the largest N of a paced step"
    )
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per step")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each")
    p.add_argument("--trainers", type=int, default=2, help="TRAIN worker processes (readers)")
    p.add_argument(
        "--thread-rate",
        type=float,
        default=None,
        help="images/s of one paced replica thread (default: engine.jsonl's images_per_s_1thread)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="threads per paced replica (default: sized)"
    )
    p.add_argument("--only", choices=("drain", "paced"), default=None)
    p.add_argument(
        "--wait-quiet", type=float, default=0.0, help="first wait up to S s for a quiet machine"
    )
    p.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    args = p.parse_args()
    args.drain_counts = _counts(args.counts)
    args.paced_counts = [c for c in PACED_COUNTS if c <= args.max]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)

    threads = args.threads or sizing.resolve_threads(config.get("cluster.trainer-threads"))
    if args.thread_rate is not None:
        rate, source = args.thread_rate, "--thread-rate"
    else:
        per_thread, source = engine_rate("images_per_s_1thread")
        if per_thread is None:
            p.error("no images_per_s_1thread in benchmarks/results/engine.jsonl: --thread-rate")
        rate = per_thread
    busy_before = None
    if args.wait_quiet > 0:
        from _cpu import wait_quiet

        busy_before = wait_quiet(args.wait_quiet)
    load_before = os.getloadavg()[0]
    res = bench(args, (rate, threads))
    res["thread_rate_from"] = source
    res["machine_cores_busy_before"] = busy_before
    res["load_before"] = round(load_before, 2)
    res["load_after"] = round(os.getloadavg()[0], 2)
    record("data_capacity", res, save=not args.no_save)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
