"""Parameter-server benchmark: prints one JSON line.

* apply: the shard's numba kernel adding a 1 MB delta in place (and a batch of 8 through
  ShardState.apply_batch, NaN check included) against numpy.add on the same arrays (the limit);
* push / pull: MB/s of ParameterServer.push / pull of a 4 MB model (4 shards x 3 replicas,
  ack="primary") on the embedded cluster, against a raw actor round trip of the same 4 MB
  payload to one PS worker (the transport's limit);
* heal: seconds from killing a PS worker that holds primaries to every shard having 3 copies
  on distinct hosts again (4 PS workers, so a spare host is there; the scheduler plugin's
  measurement).

Usage: python benchmarks/ps.py [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time

import numpy as np

logger = logging.getLogger(__name__)


def rate(fn, seconds: float) -> float:
    """Calls per second of ``fn`` over about ``seconds`` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt


def bench_apply(seconds: float) -> dict:
    from adam_dask.ps.state import ShardState, apply_rate_kernel

    n = 1 << 18  # 1 MB of float32: one shard
    rng = np.random.default_rng(0)
    values = rng.standard_normal(n).astype(np.float32)
    delta = (rng.standard_normal(n) * 1e-6).astype(np.float32)
    numpy_rate = rate(lambda: np.add(values, delta, out=values), seconds) * n
    kernel_rate = rate(lambda: apply_rate_kernel(values, delta), seconds) * n
    batch = [(rng.standard_normal(n) * 1e-6).astype(np.float32) for _ in range(8)]
    st = ShardState(0, 0, n, values)

    def numpy_batch():
        for d in batch:
            np.add(st.values, d, out=st.values)

    numpy_batch_rate = rate(numpy_batch, seconds) * n * len(batch)
    batch_rate = rate(lambda: st.apply_batch(batch), seconds) * n * len(batch)
    return {
        "apply_floats_per_s": kernel_rate,
        "numpy_add_floats_per_s": numpy_rate,
        "apply_vs_numpy": kernel_rate / numpy_rate,
        "apply_batch8_checked_floats_per_s": batch_rate,
        "numpy_add_batch8_floats_per_s": numpy_batch_rate,
        "apply_batch8_vs_numpy": batch_rate / numpy_batch_rate,
    }


class Sink:
    """The raw actor: takes and returns a payload, nothing else."""

    def __init__(self, n: int):
        self.data = np.ones(n, np.float32)

    async def take(self, x):
        return None

    async def give(self):
        return self.data


async def _die_soon():
    asyncio.get_running_loop().call_later(0.05, os._exit, 1)


def bench_cluster(seconds: float) -> dict:
    import adam_dask
    from adam_dask.cluster import workers_with_role
    from adam_dask.ps import ParameterServer

    mb = 4
    n = mb * (1 << 18)
    out = {}
    with adam_dask.cluster.local(
        ps_nodes=4, data_nodes=0, trainers=0, memory_limit="1 GiB"
    ) as client:
        ps = workers_with_role(client, "PS")
        sink = client.submit(
            Sink, n, actor=True, workers=[ps[0]], allow_other_workers=False, pure=False
        ).result()
        payload = np.ones(n, np.float32)
        raw_push = rate(lambda: sink.take(payload).result(), seconds) * mb
        raw_pull = rate(lambda: sink.give().result(), seconds) * mb
        server = ParameterServer.create(
            client, size=n, shard_bytes=1 << 20, replicas=3, ack="primary"
        )
        delta = np.full(n, 1e-3, np.float32)
        push = rate(lambda: server.push(delta), seconds) * mb
        pull = rate(lambda: server.pull(), seconds) * mb
        server.flush()
        out.update(
            {
                "payload_mb": mb,
                "push_mb_per_s": push,
                "raw_push_mb_per_s": raw_push,
                "push_vs_raw": push / raw_push,
                "pull_mb_per_s": pull,
                "raw_pull_mb_per_s": raw_pull,
                "pull_vs_raw": pull / raw_pull,
            }
        )
        stats = server.stats()
        out["max_replication_lag_after_flush"] = stats["max_replication_lag"]
        # the same payload as one shard: what the per-shard fan-out (4 calls to 3-4 nodes on
        # these 2 cores) costs against a single call
        one = ParameterServer.create(client, size=n, shard_bytes=n * 4, replicas=3, ack="primary")
        one.push(delta)
        push1 = rate(lambda: one.push(delta), seconds) * mb
        pull1 = rate(lambda: one.pull(), seconds) * mb
        one.close()
        out.update(
            {"one_shard_push_vs_raw": push1 / raw_push, "one_shard_pull_vs_raw": pull1 / raw_pull}
        )

        victim = server.placement()[0][0]
        before = len(server.routing_info()["heal_times"])
        client.run(_die_soon, workers=[victim])
        deadline = time.time() + 120
        while time.time() < deadline:
            info = server.routing_info()
            if len(info["heal_times"]) > before and info["healthy"]:
                break
            time.sleep(0.1)
        out["heal_seconds"] = info["heal_times"][-1] if len(info["heal_times"]) > before else None
        server.push(delta)
        server.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="time per measurement (default 2)")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    res = {"benchmark": "ps"}
    res.update(bench_apply(args.seconds))
    res.update(bench_cluster(args.seconds))
    res["goals"] = {
        "apply_vs_numpy": 0.8,
        "push_vs_raw": 0.7,
        "pull_vs_raw": 0.7,
        "heal_seconds": 5.0,
    }
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))


if __name__ == "__main__":
    main()
