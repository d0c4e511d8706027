"""Benchmark: communication isolation (paper section 3.3.4). Each PS machine of Adam had one NIC for
parameter updates and another for persistence, so writing the model back to storage never
delays an update. Here, on a cluster of network namespaces (adam_dask.testing.NetnsCluster,
root needed): 3 PS hosts whose links are limited to ``--rate``, an S3 server (moto) on a host of
its own, and a dense layer of ``--floats`` parameters (one copy: no forwards) whose every shard
is dirtied every ``--dirty-every`` s by ``push_outer`` (the dense-layer offload: a few hundred KB
on the wire, the whole layer rewritten), so its write-back to S3 fills the links it crosses. A
probe does what a replica does every k images for one shard (push a delta, pull the values back,
over the data plane's TCP) every ``--period`` s, on a small server of its own (``--probe-kb``,
three copies, on the same hosts), and times each round.

Two runs, the same in all but where S3 is: **shared**, on the one network the updates cross;
**isolated**, on a storage network that the PS hosts reach through a second link each. The line
(benchmarks/results/isolation.jsonl) has each run's probe latency (p50/p99, and the push's and
the pull's p50) with the write-back running and, before it, idle, and the bytes written back.

The rate is low (20 Mbit/s) so that the link, not this 2-core machine, limits the write-back:
at 100 Mbit/s moto takes in only ~10 MB/s here, the links never fill, and neither run degrades.

    python benchmarks/isolation.py [--rate 20mbit] [--floats 16777216] [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np


def run(storage: str, args) -> dict:
    import s3fs

    from adam_dask.ps import ParameterServer
    from adam_dask.testing import NetnsCluster

    with NetnsCluster(
        ps_nodes=3, data_nodes=0, trainers=0, memory_limit="3GiB", storage=storage
    ) as net:
        opts = net.storage_options()
        s3fs.S3FileSystem(**opts).mkdir("adam-isolation")
        for name in ("ps-0", "ps-1", "ps-2"):
            net.shape(name, rate=args.rate)
            if storage == "isolated":
                net.shape(name, rate=args.rate, link="eth1")
        client = net.client()
        side = int(np.sqrt(args.floats))
        server = ParameterServer.create(
            client,
            size=side * side,  # a (side x side) dense layer, dirtied by push_outer
            shard_bytes=1 << 20,
            # one copy: its pushes are not forwarded, so the load it adds is the write-back
            # alone (with three, forwarding the rewritten layer to two backups fills the
            # update links in both runs, and the runs measure replication, not persistence)
            copies=args.layer_copies,
            checkpoint="s3://adam-isolation/ck",
            storage_options=opts,
        )
        # The probe's shard lives on a server of its own (on the same PS hosts, written back
        # to the same S3): a push of a flat delta that is zero on the dense layer's shards
        # would still record itself in each of them (a version: push() is exactly-once for
        # every shard), so every probe would dirty the whole 64 MB layer and its write-back
        # would fill the links in the "idle" phase too.
        probe_server = ParameterServer.create(
            client,
            size=args.probe_kb * 256,
            shard_bytes=args.probe_kb << 10,
            checkpoint="s3://adam-isolation/probe",
            storage_options=opts,
        )
        try:
            probe = np.full(probe_server.size, 1e-6, np.float32)
            pulled = np.zeros(probe_server.size, np.float32)

            def probe_for(seconds: float) -> tuple[list[float], list[float]]:
                """A replica's round: push a delta, pull the shard back (updates in, values out
                on the PS hosts' update links); the push's and the pull's seconds."""
                pushes, pulls = [], []
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    probe_server.push(probe)
                    t1 = time.perf_counter()
                    probe_server.pull([0], out=pulled)
                    pushes.append(t1 - t0)
                    pulls.append(time.perf_counter() - t1)
                    time.sleep(args.period)
                return pushes, pulls

            server.flush()
            probe_server.flush()
            idle_push, idle_pull = probe_for(args.seconds / 2)
            stop = threading.Event()
            rng = np.random.default_rng(0)
            errs = rng.standard_normal((8, side)).astype(np.float32) * 1e-3
            acts = rng.standard_normal((8, side)).astype(np.float32)
            outer_pushes = [0]

            def dirty() -> None:
                while not stop.is_set():
                    server.push_outer(0, errs, acts, scale=1e-3)
                    outer_pushes[0] += 1
                    stop.wait(args.dirty_every)

            before = server.stats()
            t = threading.Thread(target=dirty, daemon=True)
            t.start()
            time.sleep(2)  # the write-back under way
            busy_push, busy_pull = probe_for(args.seconds)
            stop.set()
            t.join(60)
            after = server.stats()
            plane = probe_server.stats()["data_plane"]
            written = 4 * sum(
                n.get("floats_written", 0) for n in after["nodes"].values() if isinstance(n, dict)
            ) - 4 * sum(
                n.get("floats_written", 0) for n in before["nodes"].values() if isinstance(n, dict)
            )
        finally:
            probe_server.close()
            server.close()

    def ms(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q) * 1e3) if xs else float("nan")

    idle = [a + b for a, b in zip(idle_push, idle_pull)]
    busy = [a + b for a, b in zip(busy_push, busy_pull)]
    return {
        "storage": storage,
        "probe_idle_ms_p50": ms(idle, 50),
        "probe_idle_ms_p99": ms(idle, 99),
        "probe_busy_ms_p50": ms(busy, 50),
        "probe_busy_ms_p99": ms(busy, 99),
        "push_idle_ms_p50": ms(idle_push, 50),
        "push_busy_ms_p50": ms(busy_push, 50),
        "push_busy_ms_p99": ms(busy_push, 99),
        "pull_idle_ms_p50": ms(idle_pull, 50),
        "pull_busy_ms_p50": ms(busy_pull, 50),
        "probes": len(busy),
        "probe_data_plane": plane,
        "outer_pushes": outer_pushes[0],
        "written_mb": written / 1e6 if written else None,
        "writeback_lag_s": after["writeback_lag_seconds"],
    }


def main() -> None:
    from _common import record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="20mbit", help="every PS link (tc tbf)")
    ap.add_argument("--floats", type=int, default=16 << 20, help="model size (a square layer)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--period", type=float, default=0.2, help="seconds between probe rounds")
    ap.add_argument("--layer-copies", type=int, default=1, help="copies of the dense layer")
    ap.add_argument("--probe-kb", type=int, default=64, help="the probe's shard (KiB)")
    ap.add_argument("--dirty-every", type=float, default=0.5, help="seconds between push_outer")
    args = ap.parse_args()
    shared = run("shared", args)
    isolated = run("isolated", args)
    record(
        "isolation",
        {
            "load": list(os.getloadavg()),
            "rate": args.rate,
            "model_mb": args.floats * 4 / 1e6,
            "seconds": args.seconds,
            "probe_kb": args.probe_kb,
            "layer_copies": args.layer_copies,
            "period": args.period,
            "probe_busy_p50_shared_over_isolated": shared["probe_busy_ms_p50"]
            / isolated["probe_busy_ms_p50"],
            "probe_busy_p99_shared_over_isolated": shared["probe_busy_ms_p99"]
            / isolated["probe_busy_ms_p99"],
            "isolated_busy_over_idle_p50": isolated["probe_busy_ms_p50"]
            / isolated["probe_idle_ms_p50"],
            "shared_busy_over_idle_p50": shared["probe_busy_ms_p50"] / shared["probe_idle_ms_p50"],
            "shared": shared,
            "isolated": isolated,
        },
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
