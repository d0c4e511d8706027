"""Parameter-server capacity with emulated replicas (the paper's Figures 9 and 11, on one machine):
one JSON line, appended to benchmarks/results/capacity.jsonl.

A replica does not train here: it pushes the MNIST net's delta (the flat parameters of
``adam.model.spec``, ~1.19 MB of float32) every ``push_every`` (``adam.train.push-every``, 512)
images at the rate one trainer makes them, and pulls the parameters after each push, as a
training replica's communicator does. The rate is ``--images-per-second``, by default the newest
``images_per_s`` of benchmarks/results/engine.jsonl (one replica of the engine on this machine),
so a replica pushes every ``push_every / images_per_second`` seconds (~40 ms). The count of
replicas grows (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, ... up to ``--max-replicas``)
until a count is past the bound, for each of two targets:

* ours: ONE parameter-server group on the embedded cluster (3 PS workers, one loopback host
  each, ``adam.ps.copies`` copies of each ``adam.ps.shard-bytes`` shard, the default
  ``adam.ps.ack``), reached only through the public API as a replica's exchange uses it
  (``ParameterServer.buffer()``, ``push_pull(buf, out)``: the push and the pull
  in one round trip, so ours' push latency holds the pull too, ``release(buf)``), so whatever
  data plane sits behind them is measured;
* the sink (the machine's limit): a thread-per-connection TCP server started in the first PS
  worker's process that only receives the delta's bytes (``recv_into`` one preallocated buffer
  per connection) and answers one byte; a "push" is the ``sendall`` of the delta, the "pull" the
  wait for that byte.

The replicas are threads in the 4 TRAIN workers' processes (a seceded Dask task per worker per
step), each with its own connection: for ours its own copy of the server handle (unpickled from
the handle's pickle, so no handle state is shared between threads), for the sink its own socket.
Thread ``g`` of ``R`` pushes on a fixed schedule ``start + (g / R + i) * period`` (the replicas
are spread over the period, not in lock-step) and never skips a slot: a target that is too slow
shows as a growing lag. Every step runs ``--warmup`` seconds unmeasured, then ``--seconds``
measured; the steps of ours and of the sink alternate at each count, so both see the same machine.

A count is within the bound when the p99 push latency is at most ``p99_bound_ms`` (100), the
pushers achieved at least ``min_achieved`` (0.9) of the offered pushes, no pusher was more than
``max_behind_s`` (1 s) behind its schedule, and no push failed.

Keys:

* ``replicas_served`` / ``sink_replicas_served``: the largest count within the bound (counts
  are tried in order; 0 when even one replica is not); ``served_vs_sink`` their ratio;
  ``past_at`` / ``sink_past_at``: the first count past the bound (null when none was, up to
  ``--max-replicas``: the served count is then a floor).
* ``curve`` (ours) / ``sink_curve``: one dict per count tried:

  - ``replicas``; ``offered_pushes_per_s`` (replicas / period) and ``achieved_pushes_per_s``
    (pushes started in the measured window per second), ``achieved_vs_offered``;
  - ``mb_per_s``: MB (2**20 bytes) of deltas the target took in per second (achieved pushes x
    ``delta_bytes``);
  - ``push_ms_p50`` / ``push_ms_p99``, ``pull_ms_p50`` / ``pull_ms_p99``: latencies of the
    pushes and pulls started in the measured window, over all threads;
  - ``behind_s``: the largest lag of a pusher behind its schedule (at a push's start, or at the
    window's end for slots it never reached);
  - ``ps_cpu_s_per_mb``: CPU seconds (user + system, psutil) of the 3 PS worker processes in
    the window per MB pushed (for ours it pays for the pulls and the replication too; for the
    sink only the first PS process works); ``ps_cores`` / ``pusher_cores`` / ``client_cores``:
    CPU seconds per second of the PS processes, of the 4 TRAIN processes and of this process
    (which hosts the scheduler) in the window: where the machine's cores went;
    ``ps_cores_each``: the PS processes one by one (ps-0, ps-1, ps-2: a shard's primary works
    more than its backups, so they differ); ``machine_cores_busy``: the whole machine's busy
    CPU seconds per second (psutil.cpu_times, everything but idle and iowait; at ``cpus`` the
    machine is saturated), of which ``softirq_cores`` (the kernel's loopback networking, which
    no process is charged for) and ``steal_cores`` (taken by the hypervisor); ``other_cores``:
    what is left, the machine's work outside this benchmark's processes (another job on a
    shared machine: a step with much of it is not this code's figure; about 0, a little below
    under heavy loopback traffic, when the machine is quiet);
  - ``load``: the 1-minute load average at the step's end; ``within``: the bound above;
    ``errors``: the first few push/pull errors, when some failed; ``attempts``: a step past the
    bound with ``other_cores`` >= 0.25 is run again (up to twice) once the machine is quiet,
    the last attempt is kept.
* ``delta_bytes``, ``shards``, ``copies``, ``ack``: the pushed delta and the server's layout;
  ``push_every``, ``images_per_second_per_replica`` (and ``images_per_second_from``: where it
  came from), ``push_period_ms``; ``p99_bound_ms``, ``min_achieved``, ``max_behind_s``;
  ``seconds``, ``warmup``, ``max_replicas``; ``load_before`` / ``load_after``: the 1-minute
  load average before and after the run (the figures need a quiet machine);
  ``machine_cores_busy_before``: the machine's busy cores over 3 s just before the cluster
  started (the run first waits up to ``--wait-quiet`` seconds for it to fall under 0.3).

Usage: python benchmarks/capacity.py [--max-replicas 256] [--seconds 8] [--warmup 2]
       [--images-per-second IPS] [--wait-quiet 300] [--no-save]
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import sys
import time
from typing import Any

import numpy as np
from _cpu import wait_quiet
from _sink import SocketSink, stop_sink
from _step import ms, replica_threads, run_step

logger = logging.getLogger("capacity")

DEFAULT_SPEC = "conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc400,fc400,fc10"
COUNTS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
P99_BOUND_MS = 100.0
MIN_ACHIEVED = 0.9
MAX_BEHIND_S = 1.0
MAX_OTHER = 0.25  # cores of other work in a step past the bound that make it run again
RETRIES = 2
PS_NODES = 3
TRAINERS = 4  # pusher processes: each replica is a process of its own, not a thread
SINK = "_capacity_sink"  # the sink's attribute on the PS worker that runs it


# -- the two targets, as seen from a pusher thread ------------------------------------------------


class PsEndpoint:
    """One replica's connection to ours: its own copy of the server handle."""

    def __init__(self, server: Any):
        self.server = pickle.loads(pickle.dumps(server))
        self.buf = np.empty(self.server.size, np.float32)
        self.filled: set[int] = set()

    def push(self, delta: np.ndarray) -> None:
        # as a replica's exchange pushes: the update taken into a buffer of the server's,
        # handed over by reference and released; the take's own write of it is the replica's
        # training cost, so a buffer is filled once, not at every push
        buf = self.server.buffer()
        if id(buf) not in self.filled:
            np.copyto(buf, delta)
            self.filled.add(id(buf))
        out = self.server.buffer()  # where the node writes the pulled weights
        self.filled.discard(id(out))  # it will hold weights, not the delta
        self.server.push_pull(buf, out)  # push, then pull: one round trip
        self.server.release(buf)
        self.server.release(out)  # (the exchange installs it first)

    def pull(self) -> None:
        """Done with the push (``push_pull``): the push's latency holds both."""

    def close(self) -> None:
        # held pushes (ack="replay") made durable before the next step, outside the window
        self.server.settle()


class SinkEndpoint:
    """One replica's connection to the sink: a TCP socket; the pull waits for the answer."""

    def __init__(self, address: tuple[str, int]):
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def push(self, delta: np.ndarray) -> None:
        self.sock.sendall(memoryview(delta).cast("B"))

    def pull(self) -> None:
        if self.sock.recv(1) != b"\x01":
            raise ConnectionError("the sink closed the connection")

    def close(self) -> None:
        self.sock.close()


def _endpoint(target: tuple[str, Any]) -> PsEndpoint | SinkEndpoint:
    kind, what = target
    return PsEndpoint(what) if kind == "ps" else SinkEndpoint(what)


# -- the pushers: threads inside a task on a TRAIN worker -----------------------------------------


def _pusher(
    target: tuple[str, Any],
    delta: np.ndarray,
    offset: float,
    period: float,
    window: tuple[float, float, float],
    out: dict,
) -> None:
    """One emulated replica: push then pull on a fixed schedule from ``start + offset`` every
    ``period`` seconds until ``end``; latencies of the pushes started after ``measure``."""
    start, measure, end = window
    push_ms: list[float] = []
    pull_ms: list[float] = []
    starts = 0
    behind = 0.0
    try:
        ep = _endpoint(target)
    except Exception as exc:
        out.update(push_ms=[], pull_ms=[], starts=0, behind=end - start, error=repr(exc))
        return
    error = None
    i = 0
    try:
        while True:
            due = start + offset + i * period
            now = time.time()
            if due >= end or now >= end:
                break
            if now < due:
                time.sleep(due - now)
            t0 = time.perf_counter()
            began = time.time()
            ep.push(delta)
            t1 = time.perf_counter()
            ep.pull()
            t2 = time.perf_counter()
            if began >= measure:  # started in the window, whatever slot it was due in
                behind = max(behind, began - due)
                starts += 1
                push_ms.append((t1 - t0) * 1e3)
                pull_ms.append((t2 - t1) * 1e3)
            i += 1
        due = start + offset + i * period
        if due < end:  # slots the pusher never reached
            behind = max(behind, end - due)
    except Exception as exc:
        error = repr(exc)
        behind = max(behind, end - (start + offset + i * period))
    try:
        ep.close()
    except Exception as exc:
        error = error or f"close: {exc!r}"
    out.update(push_ms=push_ms, pull_ms=pull_ms, starts=starts, behind=behind, error=error)


def run_pushers(
    indices: list[int],
    replicas: int,
    window: tuple[float, float, float],
    target: tuple[str, Any],
    size: int,
    period: float,
) -> list[dict]:
    """A Dask task: one thread per index ``g`` in ``indices`` (of ``replicas``), each an emulated
    replica (:func:`_pusher`) due every ``period`` from ``start + period * g / replicas``;
    returns their results."""
    delta = np.full(size, 1e-7, np.float32)  # non-zero everywhere: every shard gets its part

    def replica(g: int, out: dict) -> None:
        # the handle finds the worker through the task's context, which the thread runs in
        _pusher(target, delta, period * g / replicas, period, window, out)

    return replica_threads(indices, replica, "pusher")


def prime(server: Any) -> None:
    """One push and pull from this process (kernels compiled, connections made)."""
    ep = PsEndpoint(server)
    ep.push(np.zeros(ep.server.size, np.float32) + 1e-7)
    ep.pull()
    ep.close()


# -- the sink: a TCP server in a PS worker's process ----------------------------------------------


class Sink(SocketSink):
    """Receives ``nbytes`` per message into a preallocated buffer and answers one byte, a
    thread per connection (TCP, on ``host``)."""

    def __init__(self, host: str, nbytes: int):
        self.nbytes = nbytes
        listener = socket.create_server((host, 0), backlog=1024)
        self.address = (host, listener.getsockname()[1])
        super().__init__(listener, "capacity-sink", nodelay=True)

    def serve(self, conn: socket.socket) -> None:
        view = memoryview(bytearray(self.nbytes))
        while True:
            got = 0
            while got < self.nbytes:
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            conn.sendall(b"\x01")


def start_sink(dask_worker: Any, nbytes: int) -> tuple[str, int]:
    from distributed.comm import get_address_host

    sink = Sink(get_address_host(dask_worker.address), nbytes)
    setattr(dask_worker, SINK, sink)
    return sink.address


# -- one step: R replicas against one target ------------------------------------------------------


def step(
    client: Any,
    trainers: list[str],
    target: tuple[str, Any],
    size: int,
    replicas: int,
    period: float,
    seconds: float,
    warmup: float,
    pids: dict[str, list[int]],
) -> dict:
    """``replicas`` emulated replicas against ``target`` for ``warmup + seconds``; the step's
    dict of the curve (see the module's docstring)."""
    delta_mb = size * 4 / (1 << 20)
    res = run_step(
        client,
        trainers,
        run_pushers,
        (target, size, period),
        replicas,
        timing=(0.005, warmup, seconds),
        pids=pids,
        log=logger,
        noun="pushers",
    )
    outs, errors = res.outs, res.errors
    push = np.array([x for o in outs for x in o["push_ms"]], np.float64)
    pull = np.array([x for o in outs for x in o["pull_ms"]], np.float64)
    behind = max((o["behind"] for o in outs), default=seconds + warmup)
    achieved = sum(o["starts"] for o in outs) / seconds
    offered = replicas / period
    mb = achieved * seconds * delta_mb

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if a.size else None

    row = {
        "replicas": replicas,
        "offered_pushes_per_s": offered,
        "achieved_pushes_per_s": achieved,
        "achieved_vs_offered": achieved / offered,
        "mb_per_s": achieved * delta_mb,
        "push_ms_p50": pct(push, 50),
        "push_ms_p99": pct(push, 99),
        "pull_ms_p50": pct(pull, 50),
        "pull_ms_p99": pct(pull, 99),
        "behind_s": behind,
        "ps_cpu_s_per_mb": sum(res.used["ps"]) / mb if mb else None,
        "ps_cores": res.cores("ps"),
        "ps_cores_each": [u / res.span for u in res.used["ps"]],
        "pusher_cores": res.cores("train"),
        "client_cores": res.cores("client"),
        **res.machine(),  # machine_cores_busy, softirq_cores, steal_cores, other_cores
        "load": os.getloadavg()[0],
    }
    p99 = row["push_ms_p99"]
    row["within"] = bool(
        not errors
        and p99 is not None
        and p99 <= P99_BOUND_MS
        and achieved >= MIN_ACHIEVED * offered
        and behind <= MAX_BEHIND_S
    )
    if errors:
        row["errors"] = sorted(set(errors))[:3]
    logger.info(
        "%s %3d replicas: %.0f/%.0f pushes/s, %.0f MB/s, push p50/p99 %s/%s ms, pull p99 %s ms, "
        "behind %.2f s, PS %.2f cores (%s), pushers %.2f, machine %.2f busy%s",
        target[0],
        replicas,
        achieved,
        offered,
        row["mb_per_s"],
        ms(row["push_ms_p50"], 1),
        ms(p99, 1),
        ms(row["pull_ms_p99"], 1),
        behind,
        row["ps_cores"],
        " ".join(f"{c:.2f}" for c in row["ps_cores_each"]),
        row["pusher_cores"],
        row["machine_cores_busy"],
        "" if row["within"] else "  -> past the bound",
    )
    return row


# -- the run --------------------------------------------------------------------------------------


def served(curve: list[dict]) -> tuple[int, int | None]:
    """The largest count within the bound, counting from the smallest up, and the first count
    past it (None when every count tried was within)."""
    n = 0
    for row in curve:
        if not row["within"]:
            return n, row["replicas"]
        n = row["replicas"]
    return n, None


def bench(args: argparse.Namespace, ips: float) -> dict:
    import adam_dask
    from adam_dask import config
    from adam_dask.cluster import PS, TRAIN, workers_with_role
    from adam_dask.model import Network
    from adam_dask.ps import ParameterServer
    from adam_dask.testing import worker_pids
    from adam_dask.train.streams import resolve_push_every

    size = int(
        Network.from_spec(
            config.get("model.spec") or DEFAULT_SPEC, input_shape=(1, 28, 28)
        ).flat.size
    )
    # one replica's push period (push-every auto: 512), as the docstring says
    push_every = resolve_push_every(config.get("train.push-every"), 1)
    period = push_every / ips
    if args.counts:
        counts = sorted({int(c) for c in args.counts.split(",")})
    else:
        counts = sorted({c for c in COUNTS if c <= args.max_replicas} | {args.max_replicas})
    curve: list[dict] = []
    sink_curve: list[dict] = []
    with adam_dask.cluster.local(
        ps_nodes=PS_NODES, data_nodes=0, trainers=TRAINERS, trainer_threads=1
    ) as client:
        ps = workers_with_role(client, PS)
        trainers = workers_with_role(client, TRAIN)
        pids = {
            "ps": list(worker_pids(client, ps).values()),
            "train": list(worker_pids(client, trainers).values()),
        }
        server = ParameterServer.create(client, size=size)
        sink_addr = client.run(start_sink, nbytes=size * 4, workers=[ps[0]])[ps[0]]
        info = {
            "delta_bytes": size * 4,
            "shards": len(server.shards),
            "copies": server.copies,
            "ack": server.ack,
        }
        try:
            client.gather([client.submit(prime, server, workers=[a], pure=False) for a in trainers])
            targets = {"ps": ("ps", server), "sink": ("sink", tuple(sink_addr))}
            curves: dict[str, list[dict]] = {"ps": curve, "sink": sink_curve}
            on = {"ps": args.only in (None, "ps"), "sink": args.only in (None, "sink")}
            for n in counts:
                for kind, target in targets.items():
                    if not on[kind]:
                        continue
                    for attempt in range(1, RETRIES + 2):
                        row = step(
                            client,
                            trainers,
                            target,
                            size,
                            n,
                            period,
                            args.seconds,
                            args.warmup,
                            pids,
                        )
                        if row["within"] or row["other_cores"] < MAX_OTHER or attempt > RETRIES:
                            break
                        # past the bound while other work shared the machine: not this code's
                        # figure; once the machine is quiet again, the step is run again
                        logger.info(
                            "%s %d: %.2f cores of other work; again once the machine is quiet",
                            kind,
                            n,
                            row["other_cores"],
                        )
                        wait_quiet(args.wait_quiet, log=logger)
                    row["attempts"] = attempt
                    curves[kind].append(row)
                    on[kind] = row["within"]
                if not any(on.values()):
                    break
        finally:
            client.run(stop_sink, attr=SINK, workers=[ps[0]])
            server.close()
    (ours, past), (sink, sink_past) = served(curve), served(sink_curve)
    return {
        "replicas_served": ours,
        "sink_replicas_served": sink,
        "served_vs_sink": ours / sink if sink else None,
        "past_at": past,
        "sink_past_at": sink_past,
        **info,
        "push_every": push_every,
        "images_per_second_per_replica": ips,
        "push_period_ms": period * 1e3,
        "p99_bound_ms": P99_BOUND_MS,
        "min_achieved": MIN_ACHIEVED,
        "max_behind_s": MAX_BEHIND_S,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "max_replicas": args.max_replicas,
        "curve": curve,
        "sink_curve": sink_curve,
    }


def main() -> None:
    from _common import engine_rate, record

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--max-replicas", type=int, default=256, help="the largest count tried (default 256)"
    )
    p.add_argument(
        "--seconds", type=float, default=8.0, help="measured seconds per step (default 8)"
    )
    p.add_argument(
        "--warmup", type=float, default=2.0, help="unmeasured seconds before each step (default 2)"
    )
    p.add_argument(
        "--images-per-second",
        type=float,
        default=None,
        help="images/s of one replica (default: the newest images_per_s of engine.jsonl)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=300.0,
        help="wait up to this long for the machine to be quiet before starting (default 300)",
    )
    p.add_argument(
        "--counts",
        default=None,
        help="replica counts to try, comma-separated (default: the growing series); for "
        "profiling one load, with --no-save",
    )
    p.add_argument(
        "--only", choices=("ps", "sink"), default=None, help="run one target only (profiling)"
    )
    p.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    args = p.parse_args()
    if (args.counts or args.only) and not args.no_save:
        p.error("--counts and --only are for profiling: add --no-save")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)

    if args.images_per_second is not None:
        ips, source = args.images_per_second, "--images-per-second"
    else:
        ips, source = engine_rate("images_per_s")
        if ips is None:
            p.error("no images_per_s in benchmarks/results/engine.jsonl: give --images-per-second")
    busy_before = wait_quiet(args.wait_quiet, log=logger)
    load_before = os.getloadavg()[0]
    res = bench(args, ips)
    res["images_per_second_from"] = source
    res["machine_cores_busy_before"] = busy_before
    res["load_before"] = round(load_before, 2)
    res["load_after"] = round(os.getloadavg()[0], 2)
    record("capacity", res, save=not args.no_save)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
