"""Benchmark: communication isolation (paper section 3.3.4). Each PS machine of Adam had one NIC for
parameter updates and another for persistence, so writing the model back to storage never
delays an update. Here, on a cluster of network namespaces (adam_dask.testing.NetnsCluster,
root needed): 3 PS hosts whose links are limited to ``--rate``, an S3 server (moto) on a host of
its own, and a model of ``--floats`` parameters whose every shard is dirtied each second by
``push_outer`` (the dense-layer offload: a few hundred KB on the wire, the whole layer rewritten),
so the write-back to S3 fills the links it crosses. A probe does what a replica does every k
images for one shard (push a delta, pull the values back) every ``--period`` s and times each
round.

Two runs, the same in all but where S3 is: **shared**, on the one network the updates cross;
**isolated**, on a storage network that the PS hosts reach through a second link each. The line
(benchmarks/results/isolation.jsonl) has each run's probe latency (p50/p99) with the write-back
running and, before it, idle, and the bytes written back.

    python benchmarks/isolation.py [--rate 100mbit] [--floats 16777216] [--seconds 20]
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
        size = side * side + 1024  # a (side x side) dense layer, then a small probe region
        server = ParameterServer.create(
            client,
            size=size,
            shard_bytes=1 << 20,
            checkpoint="s3://adam-isolation/ck",
            storage_options=opts,
        )
        try:
            probe = np.zeros(size, np.float32)
            last = len(server.shards) - 1
            probe[server.shards[last][0] :] = 1e-6  # the last shard only (zero shards: not sent)
            pulled = np.zeros(size, np.float32)

            def probe_for(seconds: float) -> list[float]:
                """A replica's round: push a delta, pull the shard back (updates in, values out
                on the PS hosts' update links)."""
                times = []
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    server.push(probe)
                    server.pull([last], out=pulled)
                    times.append(time.perf_counter() - t0)
                    time.sleep(args.period)
                return times

            server.flush()
            idle = probe_for(args.seconds / 2)
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
            busy = probe_for(args.seconds)
            stop.set()
            t.join(60)
            after = server.stats()
            written = 4 * sum(
                n.get("floats_written", 0) for n in after["nodes"].values() if isinstance(n, dict)
            ) - 4 * sum(
                n.get("floats_written", 0) for n in before["nodes"].values() if isinstance(n, dict)
            )
        finally:
            server.close()

    def ms(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q) * 1e3) if xs else float("nan")

    return {
        "storage": storage,
        "probe_idle_ms_p50": ms(idle, 50),
        "probe_idle_ms_p99": ms(idle, 99),
        "probe_busy_ms_p50": ms(busy, 50),
        "probe_busy_ms_p99": ms(busy, 99),
        "probes": len(busy),
        "outer_pushes": outer_pushes[0],
        "written_mb": written / 1e6 if written else None,
        "writeback_lag_s": after["writeback_lag_seconds"],
    }


def main() -> None:
    from _common import record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit", help="every PS link (tc tbf)")
    ap.add_argument("--floats", type=int, default=16 << 20, help="model size (a square layer)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--period", type=float, default=0.1, help="seconds between probe pushes")
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
