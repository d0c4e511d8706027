"""Model partitioning (paper 3.2, Figure 6): one replica spread over several TRAIN workers.

Parts (each stores one line in benchmarks/results/partitions.jsonl):

* ``large``: a dense model too large for one TRAIN worker under a 1 GiB memory limit trains on
  MNIST with P = 2..4 partitions, where P = 1 is refused before anything starts (the error
  line is stored); images/s and cross-partition bytes per image against P, and against the
  engine alone (``engine_images_per_second``: one thread of ``Network.step_into`` on the same
  model and mini-batch size in this process, on the same cores, measured in the same run).
* ``mnist``: the paper's MNIST net, P = 2 against P = 1 (one replica each, same cluster, same
  seeds): test accuracy per seed.
* ``cache``: the paper's cache claim (3.2.4), measured in one thread: images/s of each
  partition's layers alone (their weights small enough for L2 / L3) against the same layers run
  unpartitioned (all weights in turn), for a dense net; the pipeline's rate is the slowest
  partition's.

Run under nice: ``nice -n 19 python benchmarks/partitions.py --parts mnist,large``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from _common import mnist_subset_store, record

LARGE = "fc4096,fc4096,fc4096,fc10"  # 36.8M parameters: 147 MB of weights


def _cluster(trainers: int, memory_limit: str):
    import adam_dask

    return adam_dask.cluster.local(
        ps_nodes=3,
        data_nodes=1,
        trainers=trainers,
        trainer_threads=1,
        memory_limit=memory_limit,
    )


class _PeakMemory:
    """The largest memory (RSS, as the workers report it to the scheduler) of each TRAIN
    worker while it runs, sampled every 0.5 s."""

    def __init__(self, client):
        import threading

        self.client, self.peak = client, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        from adam_dask.cluster import TRAIN, workers_with_role

        while not self._stop.wait(0.5):
            try:
                train = set(workers_with_role(self.client, TRAIN))
                info = self.client.scheduler_info(n_workers=-1)["workers"]
            except Exception:  # the cluster is closing
                continue
            for addr, w in info.items():
                if addr in train:
                    mem = int((w.get("metrics") or {}).get("memory") or 0)
                    self.peak[addr] = max(self.peak.get(addr, 0), mem)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return sorted((round(v / 2**20) for v in self.peak.values()), reverse=True)


def _fit(client, store, spec, P, *, epochs, seed, lr, push_every, replicas=1) -> dict:
    from adam_dask.errors import AdamError
    from adam_dask.train.trainer import Trainer

    t0 = time.perf_counter()
    try:
        t = Trainer(
            store,
            model=spec,
            client=client,
            partitions=P,
            replicas=replicas,
            lr=lr,
            push_every=push_every,
            seed=seed,
            progress=False,
            checkpoint=False,
        )
    except AdamError as exc:
        return {"partitions": P, "error": str(exc)}
    peak = _PeakMemory(client)
    try:
        hist = t.fit(epochs=epochs)
    except AdamError as exc:
        return {"partitions": P, "error": str(exc), "seconds": time.perf_counter() - t0}
    finally:
        t.close()
        peak_mib = peak.stop()
    recs = hist.records
    images = sum(r["images"] for r in recs)
    seconds = sum(r["seconds"] for r in recs)
    out = {
        "partitions": P,
        "parameters": t.net.layout.size,
        "test_accuracy": recs[-1]["test_accuracy"],
        "accuracy_by_epoch": [r["test_accuracy"] for r in recs],
        "images_applied": [r["images_applied"] for r in recs],
        "images": images,
        "images_per_second": images / seconds if seconds else None,
        "cross_bytes_per_image": sum(r.get("cross_partition_bytes", 0) for r in recs)
        / max(1, images),
        "seconds": time.perf_counter() - t0,
        # each TRAIN worker's largest RSS during the run, largest first (idle ones included)
        "train_worker_peak_mib": peak_mib,
    }
    if P > 1:
        out["plan"] = t.partition_plan.describe()
        out["plan_memory_mib"] = [round(p.memory / 2**20) for p in t.partition_plan.partitions]
    return out


MNIST_NET = "conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc400,fc400,fc10"  # the paper's


def _mnist_runs(args, partitions: tuple[int, ...], replicas: int = 1) -> list[dict]:
    """Fits of the paper's MNIST net on the subset, for each seed one per number of
    ``partitions``, in that order; each run carries its seed. ``replicas`` of one thread each,
    on as many TRAIN workers (at least 2); one replica pushes every 512 images, more every
    ``push-every: auto``."""
    store = mnist_subset_store(args.images, args.test_images)
    runs = []
    with _cluster(max(2, replicas), "2 GiB") as client:
        for seed in range(args.seeds):
            for P in partitions:
                r = _fit(
                    client,
                    store,
                    MNIST_NET,
                    P,
                    epochs=args.epochs,
                    seed=seed,
                    lr=0.05,
                    push_every=512 if replicas == 1 else None,
                    replicas=replicas,
                )
                r.pop("plan", None)
                runs.append({"seed": seed, **r})
                print(runs[-1], flush=True)
    return runs


def part_mnist(args) -> dict:
    runs = _mnist_runs(args, (1, 2))
    acc = {P: [r["test_accuracy"] for r in runs if r["partitions"] == P] for P in (1, 2)}
    rate = {P: [r["images_per_second"] for r in runs if r["partitions"] == P] for P in (1, 2)}
    mean = {P: sum(v) / len(v) for P, v in acc.items()}
    return {
        "part": "mnist",
        "spec": MNIST_NET,
        "images": args.images,
        "test_images": args.test_images,
        "epochs": args.epochs,
        "seeds": args.seeds,
        "accuracy_p1": acc[1],
        "accuracy_p2": acc[2],
        "mean_accuracy_p1": mean[1],
        "mean_accuracy_p2": mean[2],
        "accuracy_p2_minus_p1": mean[2] - mean[1],
        "images_per_second_p1": rate[1],
        "images_per_second_p2": rate[2],
        "rate_ratio_p2_vs_p1": (sum(rate[2]) / sum(rate[1])),
        "runs": runs,
    }


def engine_alone(spec: str, batch_size: int, seconds: float) -> float:
    """images/s (wall) of one thread training ``spec`` with the fused step on random
    28x28 mini-batches of ``batch_size``, for about ``seconds`` after a warm-up: the rate a
    replica of the whole model would reach on one core with no parameter server."""
    import numpy as np

    from adam_dask.model import Network

    net = Network.from_spec(spec, (1, 28, 28), "relu", seed=0)
    rng = np.random.default_rng(0)
    x = rng.random((batch_size, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, batch_size).astype(np.int64)
    ctx = net.context(batch_size)
    vel = np.zeros(1, np.float32)
    net.step_into(ctx, x, y, batch_size, 1e-4, 0.0, vel)  # compile
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        net.step_into(ctx, x, y, batch_size, 1e-4, 0.0, vel)
        steps += 1
    rate = steps * batch_size / (time.perf_counter() - t0)
    del net, ctx
    return rate


def part_large(args) -> dict:
    store = mnist_subset_store(args.large_images, args.test_images)
    engine = engine_alone(args.large_spec, 8, args.engine_seconds)
    print({"engine_images_per_second": engine}, flush=True)
    runs = []
    Ps = [int(p) for p in args.large_partitions.split(",")]
    with _cluster(max(Ps), "1 GiB") as client:
        for P in Ps:
            r = _fit(
                client,
                store,
                args.large_spec,
                P,
                epochs=1,
                seed=0,
                lr=args.large_lr,
                push_every=args.large_push_every,
            )
            runs.append(r)
            print({k: v for k, v in r.items() if k != "plan"}, flush=True)
            if "plan" in r:
                print(r["plan"], flush=True)
    ok = [r for r in runs if "error" not in r]
    base = ok[0]["images_per_second"] if ok else None
    return {
        "part": "large",
        "spec": args.large_spec,
        "worker_memory_limit": "1 GiB",
        "images": args.large_images,
        "test_images": args.test_images,
        "push_every": args.large_push_every,
        "lr": args.large_lr,
        "refused": {r["partitions"]: r["error"] for r in runs if "error" in r},
        "accuracy": {r["partitions"]: r["test_accuracy"] for r in ok},
        "images_per_second": {r["partitions"]: r["images_per_second"] for r in ok},
        "rate_vs_first": {r["partitions"]: r["images_per_second"] / base for r in ok if base},
        "engine_images_per_second": engine,
        "rate_vs_engine": {r["partitions"]: r["images_per_second"] / engine for r in ok},
        "cross_bytes_per_image": {r["partitions"]: r["cross_bytes_per_image"] for r in ok},
        "runs": runs,
    }


def part_cache(args) -> dict:
    """One thread: each stage alone, repeated, against all stages in turn (the unpartitioned
    replica's work) on the same mini-batches."""
    import numpy as np

    from adam_dask.model import Network
    from adam_dask.model.stage import stages_of

    spec = args.cache_spec
    net = Network.from_spec(spec, input_shape=(1, 28, 28), seed=0)
    P = len(net.layers)
    stages = stages_of(net, [(k, k + 1) for k in range(P)])
    B = 8
    rng = np.random.default_rng(0)
    x = rng.random((B, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, B)
    ctxs = [s.context(B) for s in stages]
    accs = [np.zeros(s.size, np.float32) for s in stages]
    ins, outs = [], []
    inp = x
    for s, c in zip(stages, ctxs):
        ins.append(inp.copy())
        inp = s.forward_into(c, ins[-1], B).copy()
        outs.append(np.zeros_like(inp))

    def stage_step(k):
        s, c = stages[k], ctxs[k]
        s.forward_into(c, ins[k], B)
        if s.last:
            s.backward_update(c, B, 1e-4, accs[k], labels=y)
        else:
            s.backward_update(c, B, 1e-4, accs[k], dout=outs[k])

    for k in range(P):  # compile
        stage_step(k)
    steps = args.cache_steps
    t = time.perf_counter()
    for _ in range(steps):
        for k in range(P):
            stage_step(k)
    whole = time.perf_counter() - t
    alone = []
    for k in range(P):
        t = time.perf_counter()
        for _ in range(steps):
            stage_step(k)
        alone.append(time.perf_counter() - t)
    return {
        "part": "cache",
        "spec": spec,
        "batch_size": B,
        "steps": steps,
        "stage_weight_mib": [round(s.size * 4 / 2**20, 2) for s in stages],
        "l2_l3": "4 MiB L2 (2 instances), 480 MiB L3 (lscpu)",
        "unpartitioned_images_per_second": steps * B / whole,
        "stage_alone_images_per_second": [steps * B / a for a in alone],
        # the same layers, each with its weights to itself, against all of them in turn
        "sum_alone_vs_whole_seconds": sum(alone) / whole,
        "pipeline_bound_vs_unpartitioned": (steps * B / max(alone)) / (steps * B / whole),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="mnist,large,cache")
    ap.add_argument("--images", type=int, default=20000, help="mnist part: training images")
    ap.add_argument("--test-images", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--large-images", type=int, default=4096)
    ap.add_argument(
        "--large-spec",
        default=LARGE,
        help=f"the large part's model ({LARGE}; fc40000,fc10: one layer too wide for a worker)",
    )
    ap.add_argument("--large-partitions", default="1,2,3,4")
    ap.add_argument("--large-push-every", type=int, default=512)
    ap.add_argument("--large-lr", type=float, default=0.01)
    ap.add_argument(
        "--engine-seconds", type=float, default=10.0, help="large part: the engine alone's run"
    )
    ap.add_argument("--cache-spec", default="fc896,fc896,fc896,fc10")
    ap.add_argument("--cache-steps", type=int, default=400)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for part in [p.strip() for p in args.parts.split(",") if p.strip()]:
        load = [round(v, 2) for v in os.getloadavg()]
        parts = {"large": part_large, "mnist": part_mnist, "cache": part_cache}
        line = parts[part](args)
        line["load"] = load
        line["load_after"] = [round(v, 2) for v in os.getloadavg()]
        record("partitions", line, save=not args.no_save)


if __name__ == "__main__":
    main()
