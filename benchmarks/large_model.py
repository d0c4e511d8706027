"""Dense-heavy models of about 10M and 50M parameters on 28x28 MNIST: the PS and the dense offload.

    python benchmarks/large_model.py                      # both models, one line each
    python benchmarks/large_model.py --models 10M --images 2048 --push-every 64

For each model (``fc2048,fc2048,fc2048,fc10``: 10.0M parameters; ``fc4096 x4,fc10``: 53.6M),
one JSON line appended to benchmarks/results/large_model.jsonl (``_common.record``) with:

* ``engine``: images/s of one replica thread in this process, the fused step
  (``Network.step_into``) against the layer-by-layer one (``backward_into`` + ``sgd_update``);
* ``ps``: on the embedded cluster (3 PS, 1 data, 2 trainer workers), the model as
  ``shards`` of ``adam.ps.shard-bytes``; ``ParameterServer.push`` / ``pull`` of the whole model
  in MB/s against a raw actor round trip of the same payload to one PS worker
  (``push_vs_raw``, ``pull_vs_raw``);
* ``train`` / ``train_offload``: ``Trainer.fit(epochs=1)`` on the first ``--images`` MNIST
  training images, 2 replicas x 1 thread, ``push_every`` k, plain SGD, without and with
  ``offload_dense`` (the paper's outer-product offload for the dense layers where
  k * (in + out) < in * out): ``images_per_s``, the layers offloaded, and bytes per trained
  image: ``sent_bytes_per_image`` counted on the wire (the bytes the TRAIN worker processes'
  Dask TCP comms write: pushes, pull requests, data requests, framing; counted by a wrapper
  around ``distributed.comm.tcp.TCP.write`` installed in those processes) and
  ``pushed_bytes_per_image`` (what the exchange hands the PS per image: the flat delta plus
  the offload terms, computed), beside ``ideal_bytes_per_image``: the delta without the
  offloaded weights (they travel as terms) plus the terms, which is what the paper's protocol
  sends.

With ``--netns RATE`` (root) the cluster is a cluster of network namespaces
(``adam_dask.testing.NetnsCluster``) whose every link is limited to RATE (``tc`` token bucket, e.g.
``1gbit``, the paper's scale): bandwidth is then what binds, and each run's line gets
``link_bytes`` (bytes each host's link carried during the run, both ways, from the kernel's
counters: the data plane's bytes included) and ``link_bytes_per_image`` for the TRAIN hosts.

``ack`` is the PS's acknowledgement mode of the run (``--ack``, default config
``adam.ps.ack``). ``load`` is os.getloadavg() before and after: the machine is shared, so the rates and ratios
need a quiet machine to mean much; the byte counts do not depend on load.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import record

logger = logging.getLogger(__name__)

MODELS = {
    "10M": "fc2048,fc2048,fc2048,fc10",
    "50M": "fc4096,fc4096,fc4096,fc4096,fc10",
}


# -- the data: a slice of real MNIST as a dataset store --------------------------------------------


def mnist_subset_store(n_train: int, n_test: int) -> str:
    """A dataset store of the first ``n_train`` / ``n_test`` MNIST images (real images, fewer
    of them: an epoch of a 50M-parameter model on all 60000 takes too long here)."""
    from adam_dask.data.ingest import MNIST_FILES, ingest, mnist_location, read_idx
    from adam_dask.testing import write_idx

    root = mnist_location()
    folder = Path(tempfile.gettempdir()) / f"adam-dask-large-model-{n_train}-{n_test}"
    store = folder / "mnist.zarr"
    if (store / "train").exists() and (store / "test").exists():
        return str(store)
    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    for split, n, prefix in (("train", n_train, "train"), ("test", n_test, "t10k")):
        imgs, labs = MNIST_FILES[split]
        write_idx(src / f"{prefix}-images-idx3-ubyte.gz", read_idx(f"{root}/{imgs}")[:n])
        write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", read_idx(f"{root}/{labs}")[:n])
    ingest(str(src), str(store), overwrite=True)
    return str(store)


# -- the engine alone ---------------------------------------------------------------------------------


def engine_rates(spec: str, batch_size: int, steps: int) -> dict:
    """images/s of one thread, fused step against layer-by-layer (best of ``steps`` steps
    after a warm-up, CPU time of the thread so that other processes' load counts less)."""
    from adam_dask.model import Network
    from adam_dask.model import kernels as K

    net = Network.from_spec(spec, (1, 28, 28), "relu", seed=0)
    rng = np.random.default_rng(0)
    x = rng.random((batch_size, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, batch_size).astype(np.int64)
    ctx = net.context(batch_size)
    vel = np.zeros(1, np.float32)

    def fused():
        net.step_into(ctx, x, y, batch_size, 1e-4, 0.0, vel)

    def layered():
        net.backward_into(ctx, x, y, batch_size)
        K.sgd_update(net.flat, ctx.grad, vel, 1e-4, 0.0)

    out = {"parameters": net.layout.size}
    for name, f in (("fused", fused), ("layered", layered)):
        f()
        best = float("inf")
        for _ in range(steps):
            t0 = time.thread_time()
            f()
            best = min(best, time.thread_time() - t0)
        out[f"{name}_images_per_cpu_s"] = round(batch_size / best, 1)
    out["fused_speedup"] = round(out["fused_images_per_cpu_s"] / out["layered_images_per_cpu_s"], 3)
    return out


# -- the parameter server against a raw transfer ----------------------------------------------------


class Sink:
    """The raw actor: takes and returns a payload, nothing else."""

    def __init__(self, n: int):
        self.data = np.ones(n, np.float32)

    async def take(self, x):
        return None

    async def give(self):
        return self.data


def timed(fn, repeats: int) -> float:
    """Best seconds of ``repeats`` calls of ``fn`` (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def ps_rates(client, size: int, repeats: int) -> dict:
    from adam_dask import config
    from adam_dask.cluster import workers_with_role
    from adam_dask.ps import ParameterServer

    mb = size * 4 / 1e6
    ps = workers_with_role(client, "PS")
    sink = client.submit(
        Sink, size, actor=True, workers=[ps[0]], allow_other_workers=False, pure=False
    ).result()
    payload = np.ones(size, np.float32)
    raw_push = mb / timed(lambda: sink.take(payload).result(), repeats)
    raw_pull = mb / timed(lambda: sink.give().result(), repeats)
    shard_bytes = int(config.get("ps.shard-bytes"))
    server = ParameterServer.create(client, size=size, shard_bytes=shard_bytes)
    try:
        delta = np.full(size, 1e-6, np.float32)
        push = mb / timed(lambda: server.push(delta), repeats)
        pull = mb / timed(lambda: server.pull(), repeats)
        shards = len(server.shards)
    finally:
        server.close()
    return {
        "payload_mb": round(mb, 1),
        "shard_bytes": shard_bytes,
        "shards": shards,
        "push_mb_per_s": push,
        "raw_push_mb_per_s": raw_push,
        "push_vs_raw": push / raw_push,
        "pull_mb_per_s": pull,
        "raw_pull_mb_per_s": raw_pull,
        "pull_vs_raw": pull / raw_pull,
    }


# -- training, without and with the dense offload -------------------------------------------------


def _count_writes() -> int:
    """In a worker process: count the bytes its TCP comms write (Dask's ``TCP.write`` returns
    them: frames and headers, everything a push, a pull request or a data request puts on the
    wire). Benchmark instrumentation, installed once per process; returns the count so far."""
    from distributed.comm import tcp

    if not getattr(tcp.TCP.write, "_adam_counted", False):
        orig = tcp.TCP.write

        async def write(self, msg, serializers=None, on_error="message"):
            n = await orig(self, msg, serializers=serializers, on_error=on_error)
            tcp._adam_bytes_written = getattr(tcp, "_adam_bytes_written", 0) + n
            return n

        write._adam_counted = True  # type: ignore[attr-defined]
        tcp.TCP.write = write
    return int(getattr(tcp, "_adam_bytes_written", 0))


def bytes_written(client, addrs) -> int:
    """The bytes the worker processes at ``addrs`` have written to their TCP comms, summed."""
    return sum(client.run(_count_writes, workers=list(addrs)).values())


def payload_bytes(spec: str, push_every: int, offload: list[str]) -> dict:
    """Bytes per image of one replica's pushes: as the exchange builds them (the whole flat
    delta each push, plus the terms) and as the paper's protocol would (the delta without the
    offloaded weights, plus the terms)."""
    from adam_dask.model import Network

    net = Network.from_spec(spec, (1, 28, 28), "relu", seed=0)
    size = net.layout.size
    terms = offloaded = 0
    for prefix in offload:
        o, i = net.parameters[f"{prefix}.weight"].shape
        terms += push_every * (i + o)
        offloaded += i * o
    return {
        "pushed_bytes_per_image": 4 * (size + terms) / push_every,
        "ideal_bytes_per_image": 4 * (size - offloaded + terms) / push_every,
        "delta_only_bytes_per_image": 4 * size / push_every,
    }


def train_once(client, store: str, spec: str, args, offload: bool) -> dict:
    from adam_dask.cluster import workers_with_role
    from adam_dask.model.partition import profitable_offload
    from adam_dask.train import Trainer

    trainers = workers_with_role(client, "TRAIN")
    trainer = Trainer(
        store,
        model=spec,
        client=client,
        push_every=args.push_every,
        lr=args.lr,
        momentum=0.0,
        batch_size=args.batch_size,
        threads=1,
        augment=False,
        progress=False,
        offload_dense=offload,
    )
    net = getattr(args, "_net", None)
    try:
        before = bytes_written(client, trainers) if net is None else 0
        links_before = link_bytes(net) if net is not None else {}
        t0 = time.perf_counter()
        hist = trainer.fit(epochs=1)
        wall = time.perf_counter() - t0
        sent = bytes_written(client, trainers) - before if net is None else 0
        links_after = link_bytes(net) if net is not None else {}
    finally:
        trainer.close()
    rec = hist.records[-1]
    images = int(rec["images"])
    layers = profitable_offload(trainer.net, args.push_every) if offload else []
    out = {
        "images": images,
        "images_per_s": rec["images_per_second"],
        "wall_seconds": wall,
        "test_accuracy": rec["test_accuracy"],
        "ps_fraction": rec.get("ps_fraction"),
        "offloaded_layers": layers,
        "sent_bytes_per_image": sent / max(images, 1),
    }
    out.update(payload_bytes(spec, args.push_every, layers))
    if net is not None:
        moved = {h: links_after[h] - links_before[h] for h in links_after}
        out["link_bytes"] = moved
        train_hosts = [h for h in moved if h.startswith("train-")]
        out["link_bytes_per_image"] = sum(moved[h] for h in train_hosts) / max(images, 1)
        out.pop("sent_bytes_per_image")
    return out


def link_bytes(net) -> dict[str, int]:
    """{host: bytes its link carried so far, both ways} (the root side's kernel counters)."""
    out = {}
    for name, host in net.hosts.items():
        total = 0
        for d in ("rx_bytes", "tx_bytes"):
            total += int(Path(f"/sys/class/net/{host.veth}/statistics/{d}").read_text())
        out[name] = total
    return out


def attempt(fn, *args, **kwargs) -> dict:
    """``fn``'s figures, or ``{"error": ...}``: one part failing (the PS and the trainer are
    being reworked) still leaves the others' figures in the line."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        logger.exception("%s failed", fn.__name__)
        return {"error": f"{type(e).__name__}: {e}"}


def run_model(name: str, args, store: str) -> dict:
    import adam_dask

    spec = MODELS[name]
    line: dict = {
        "model": name,
        "spec": spec,
        "push_every": args.push_every,
        "batch_size": args.batch_size,
        "load": [round(v, 2) for v in os.getloadavg()],
    }
    line["engine"] = engine_rates(spec, args.batch_size, args.steps)
    size = line["engine"]["parameters"]
    import contextlib

    with contextlib.ExitStack() as stack:
        if args.netns:
            from adam_dask.testing import NetnsCluster

            net = stack.enter_context(
                NetnsCluster(ps_nodes=3, data_nodes=1, trainers=2, memory_limit="4GiB")
            )
            for h in net.hosts:
                net.shape(h, rate=args.netns)
            args._net = net
            line["link_rate"] = args.netns
            client = net.client()
        else:
            client = stack.enter_context(
                adam_dask.cluster.local(ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1)
            )
        if not args.no_ps:
            line["ps"] = attempt(ps_rates, client, size, args.repeats)
        if not args.no_train:
            line["train"] = attempt(train_once, client, store, spec, args, offload=False)
            line["train_offload"] = attempt(train_once, client, store, spec, args, offload=True)
            a, b = line["train"], line["train_offload"]
            if "error" not in a and "error" not in b:
                key = "link_bytes_per_image" if args.netns else "sent_bytes_per_image"
                line["offload_sent_bytes_ratio"] = b[key] / a[key]
                line["offload_epoch_seconds_ratio"] = b["wall_seconds"] / a["wall_seconds"]
                line["offload_ideal_bytes_ratio"] = (
                    b["ideal_bytes_per_image"] / a["ideal_bytes_per_image"]
                )
    line["load_after"] = [round(v, 2) for v in os.getloadavg()]
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="10M,50M", help="comma-separated: 10M, 50M")
    ap.add_argument("--images", type=int, default=2048, help="MNIST training images (2048)")
    ap.add_argument("--test-images", type=int, default=1000, help="MNIST test images (1000)")
    ap.add_argument("--push-every", type=int, default=64, help="images between pushes, k (64)")
    ap.add_argument("--batch-size", type=int, default=8, help="images per replica step (8)")
    ap.add_argument("--lr", type=float, default=0.01, help="learning rate (0.01)")
    ap.add_argument("--steps", type=int, default=5, help="engine: timed steps per path (5)")
    ap.add_argument("--repeats", type=int, default=3, help="PS: timed calls per figure (3)")
    ap.add_argument(
        "--ack",
        default=None,
        help="the PS's ack mode for this run (default: config adam.ps.ack): replay, all, primary",
    )
    ap.add_argument(
        "--netns", default=None, metavar="RATE", help="namespace cluster, links at RATE"
    )
    ap.add_argument("--no-ps", action="store_true", help="skip the push/pull figures")
    ap.add_argument("--no-train", action="store_true", help="skip the training runs")
    ap.add_argument("--no-save", action="store_true", help="print the lines, do not append")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in names:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}: choose from {', '.join(MODELS)}")
    import dask

    from adam_dask import config

    store = mnist_subset_store(args.images, args.test_images) if not args.no_train else ""
    with dask.config.set({"adam.ps.ack": config.get("ps.ack", args.ack)}):
        for m in names:
            line = {"ack": config.get("ps.ack"), **run_model(m, args, store)}
            record("large_model", line, save=not args.no_save)


if __name__ == "__main__":
    main()
