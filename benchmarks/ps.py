"""Parameter-server benchmark: one JSON line, appended to benchmarks/results/ps.jsonl.

Everything below is measured in one run, so each figure has its peer from the same machine state.
The PS part runs on the embedded cluster with 4 PS workers (one loopback host each), a 4 MB model
in 1 MB shards, 3 copies of each shard.

* apply: the shard's numba kernel adding a 1 MB delta in place (and a batch of 8 through
  ``ShardState.apply_batch``, NaN check included) against ``numpy.add`` on the same arrays.
* transfer: MB/s of ``ParameterServer.push`` / ``pull`` (into a reused buffer) of the 4 MB model
  against a raw actor round trip of the same 4 MB payload to one PS worker (``raw_*``: the
  transport's limit, measured before and after the PS figures and averaged; ``raw_drift`` is
  after/before), once with the default ack (``adam.ps.ack``: ``ack``, keys ``push_vs_raw``,
  ``pull_vs_raw``, ...) and once with ``ack="primary"`` (``primary_*`` keys); ``one_shard_*``:
  the default ack with the whole model as one 4 MB shard; ``one_copy_primary_*``: one copy,
  ``ack="primary"``, the protocol alone without the replication that shares the cores.
* fail-over (``sigkill_*``, ``sigstop_*``), default settings: a thread pushes small-integer
  deltas (exact in float32) into a fresh server; after ``--seconds`` of pushes the primary of
  shard 0 gets SIGKILL (``testing.hard_kill(wait=False)``) or SIGSTOP (``testing.freeze``) from
  this process. Timed from the signal:

  - ``*_served_seconds``: until the first push *started* after the signal completes, i.e. every
    shard has a primary that answers again (it includes that one push's own time, about
    ``*_push_seconds_median``);
  - ``*_healed_seconds``: until ``routing_info()`` is healthy without the victim: every shard
    served and back at 3 copies on distinct hosts;
  - ``*_controller_heal_seconds``: the controller's own figure (from when it noticed the loss).

  After the heal (and, for SIGSTOP, after SIGCONT wakes the frozen node) the pushes go on for
  ``--seconds`` more; then flush and pull. ``*_lost_max_abs`` is the largest difference between
  the pulled parameters and the initial values plus every acknowledged push: 0 when no
  acknowledged update was lost and none was applied twice. ``*_pushes`` counts the pushes,
  ``*_error`` names a push that failed (the sum is then ambiguous), ``sigstop_refused_stale`` the
  calls the fenced node's stale generation had refused.
* training: ``Trainer.fit(epochs=1)`` on real MNIST (``--train-images`` of it) on the embedded
  cluster with its defaults, with the default ack and with ``ack="primary"``, after one untimed
  warm-up epoch, in the order default, primary, primary, default, ... (``--train-rounds`` pairs)
  so drift falls on both; ``train_images_per_s`` / ``primary_train_images_per_s`` are the means and
  ``train_cost_vs_primary`` = 1 - default / primary (issue 10's goal: <= 0.10).

``goals`` holds the targets (issues 10 and 12). ``load`` is the 1-minute load average before and
after: the rates need a quiet machine.

Usage: python benchmarks/ps.py [--seconds 3] [--train-rounds 2] [--train-images 60000] [--no-save]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

logger = logging.getLogger(__name__)

MB = 4  # the model: 4 MB of float32
N = MB * (1 << 18)
SHARD_BYTES = 1 << 20
PACE = 0.01  # seconds between two data-plane calls of bench_plane
ROUNDS = 5  # alternating rounds of the client's back-to-back calls and the socket
COPIES = 3
PS_NODES = 4


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


# -- apply kernel -----------------------------------------------------------------------------------


def bench_apply(seconds: float) -> dict:
    from adam_dask.ps.protocol.shard import ShardState
    from adam_dask.ps.protocol.shard_kernels import apply_rate_kernel

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


# -- push and pull against a raw actor transfer ----------------------------------------------------


class Sink:
    """The raw actor: takes and returns a payload, nothing else."""

    def __init__(self, n: int):
        self.data = np.ones(n, np.float32)

    async def take(self, x):
        return None

    async def give(self):
        return self.data


def bench_transfer(client, acks: list[str], seconds: float) -> dict:
    """push / pull MB/s of the 4 MB model for each ack in ``acks`` (the default first) against
    the raw round trip; keys of the first ack unprefixed, of the others prefixed by the ack."""
    from adam_dask.cluster import PS, workers_with_role
    from adam_dask.ps import ParameterServer

    ps = workers_with_role(client, PS)
    sink = client.submit(
        Sink, N, actor=True, workers=[ps[0]], allow_other_workers=False, pure=False
    ).result()
    payload = np.ones(N, np.float32)

    def raw() -> tuple[float, float]:
        return (
            rate(lambda: sink.take(payload).result(), seconds) * MB,
            rate(lambda: sink.give().result(), seconds) * MB,
        )

    raw_before = raw()
    delta = np.full(N, 1e-3, np.float32)
    buf = np.zeros(N, np.float32)
    measured: dict[str, tuple[float, float, int]] = {}
    for ack in acks:
        server = ParameterServer.create(
            client, size=N, shard_bytes=SHARD_BYTES, copies=COPIES, ack=ack
        )
        try:
            push = rate(lambda s=server: s.push(delta), seconds) * MB
            pull = rate(lambda s=server: s.pull(out=buf), seconds) * MB
            server.flush()
            lag = server.stats()["max_replication_lag"]
        finally:
            server.close()
        measured[ack] = (push, pull, lag)
    # one copy, ack="primary": the protocol alone (split, route, apply, answer), without the
    # replication that shares the machine's cores with the pushes
    bare = ParameterServer.create(client, size=N, shard_bytes=SHARD_BYTES, copies=1, ack="primary")
    try:
        push_bare = rate(lambda: bare.push(delta), seconds) * MB
        pull_bare = rate(lambda: bare.pull(out=buf), seconds) * MB
    finally:
        bare.close()
    # the same payload as one shard: what the per-shard fan-out (4 calls to 3-4 nodes) costs
    one = ParameterServer.create(client, size=N, shard_bytes=N * 4, copies=COPIES, ack=acks[0])
    try:
        push1 = rate(lambda: one.push(delta), seconds) * MB
        pull1 = rate(lambda: one.pull(out=buf), seconds) * MB
    finally:
        one.close()
    raw_after = raw()
    raw_push = (raw_before[0] + raw_after[0]) / 2
    raw_pull = (raw_before[1] + raw_after[1]) / 2
    out: dict = {
        "payload_mb": MB,
        "shard_mb": SHARD_BYTES / (1 << 20),
        "copies": COPIES,
        "raw_push_mb_per_s": raw_push,
        "raw_pull_mb_per_s": raw_pull,
        "raw_drift": [raw_after[0] / raw_before[0], raw_after[1] / raw_before[1]],
    }
    for i, ack in enumerate(acks):
        push, pull, lag = measured[ack]
        pre = "" if i == 0 else f"{ack}_"
        out.update(
            {
                f"{pre}push_mb_per_s": push,
                f"{pre}push_vs_raw": push / raw_push,
                f"{pre}pull_mb_per_s": pull,
                f"{pre}pull_vs_raw": pull / raw_pull,
                f"{pre}max_replication_lag_after_flush": lag,
            }
        )
    out["one_copy_primary_push_vs_raw"] = push_bare / raw_push
    out["one_copy_primary_pull_vs_raw"] = pull_bare / raw_pull
    out["one_shard_push_vs_raw"] = push1 / raw_push
    out["one_shard_pull_vs_raw"] = pull1 / raw_pull
    return out


# -- fail-over from real signals --------------------------------------------------------------------


def _wait(cond, timeout: float, step: float = 0.02):
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    return None


def bench_fault(client, kind: str, seconds: float, timeout: float, seed: int) -> dict:
    """SIGKILL (``kind="sigkill"``) or SIGSTOP (``"sigstop"``) the primary of shard 0 while a
    thread pushes; see the module's docstring for the keys (prefixed by ``kind``)."""
    from adam_dask.ps import ParameterServer
    from adam_dask.testing import PushLoad, freeze, hard_kill, thaw

    rng = np.random.default_rng(seed)
    init = rng.integers(-8, 8, N).astype(np.float32)
    server = ParameterServer.create(
        client, size=N, shard_bytes=SHARD_BYTES, copies=COPIES, init=init
    )
    pusher = PushLoad(server, seed)
    frozen: dict = {}
    out: dict = {}
    try:
        before = server.routing_info()
        victim = before["routing"][0][0]
        heals_before = len(before["heal_times"])
        pusher.start()
        _wait(lambda: len(pusher.times) >= 3 or pusher.error, timeout)
        time.sleep(seconds)
        if kind == "sigkill":
            hard_kill(client, [victim], wait=False)
        else:
            frozen = freeze(client, [victim])
        t_sig = time.perf_counter()  # the signal went out just before the call returned

        def healed():
            info = server.routing_info()
            ok = (
                info["healthy"]
                and not info["pending"]
                and all(victim not in h for h in info["routing"])
            )
            return info if ok else None

        info = _wait(lambda: healed() or pusher.error, timeout)
        healed_s = time.perf_counter() - t_sig if isinstance(info, dict) else None
        served = _wait(lambda: pusher.served_after(t_sig) or pusher.error, timeout)
        served_s = served if isinstance(served, float) else None
        if frozen:
            thaw(frozen)
            frozen = {}
        n = len(pusher.times)
        time.sleep(seconds)
        _wait(lambda: len(pusher.times) >= n + 3 or pusher.error, timeout)
        pusher.stop.set()
        pusher.join(timeout)
        server.flush()
        got = server.pull().astype(np.float64)
        lost = float(np.max(np.abs(got - (init.astype(np.float64) + pusher.total()))))
        stats = server.stats()
        durations = sorted(t1 - t0 for t0, t1 in pusher.times)
        info = server.routing_info()
        out = {
            "served_seconds": served_s,
            "healed_seconds": healed_s,
            "controller_heal_seconds": (
                info["heal_times"][-1] if len(info["heal_times"]) > heals_before else None
            ),
            "lost_max_abs": lost,
            "pushes": len(pusher.times),
            "push_seconds_median": durations[len(durations) // 2] if durations else None,
            "push_seconds_max": durations[-1] if durations else None,
            "declared_dead": stats["declared_dead"],
            "replayed": stats["replayed"],
        }
        if kind == "sigstop":
            out["refused_stale"] = stats["refused_stale"]
        if pusher.error is not None:
            out["error"] = f"{type(pusher.error).__name__}: {pusher.error}"
    except Exception as exc:  # one scenario failing still leaves the line
        logger.exception("%s scenario failed", kind)
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if frozen:
            thaw(frozen)
        pusher.stop.set()
        if pusher.is_alive():
            pusher.join(timeout)
        try:
            server.close()
        except Exception:
            logger.debug("close failed", exc_info=True)
    return {f"{kind}_{k}": v for k, v in out.items()}


def bench_cluster(acks: list[str], seconds: float, timeout: float, memory_limit: str) -> dict:
    import adam_dask
    from adam_dask.cluster import PS, workers_with_role

    out: dict = {}
    with adam_dask.cluster.local(
        ps_nodes=PS_NODES, data_nodes=0, trainers=0, memory_limit=memory_limit
    ) as client:
        out.update(bench_transfer(client, acks, seconds))
        out.update(bench_fault(client, "sigkill", seconds, timeout, seed=1))
        # the nanny restarts the killed worker under a new address: 4 hosts again, so the frozen
        # node's shards can get 3 copies on the other three
        back = _wait(lambda: len(workers_with_role(client, PS)) >= PS_NODES, timeout, 0.1)
        if not back:
            out["sigstop_error"] = "the killed PS worker did not come back"
        else:
            out.update(bench_fault(client, "sigstop", seconds, timeout, seed=2))
    return out


# -- the data plane against a plain socket ----------------------------------------------------------


def _start_socket_sink(dask_worker=None):
    """A plain TCP peer in this PS worker's process: reads a length-prefixed payload into a
    buffer and answers one byte (a push), or answers a one-byte request with ``n`` bytes (a
    pull). Returns (host, port)."""
    import socket
    import threading

    host = dask_worker.address.split("://")[1].rsplit(":", 1)[0]
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen()

    def serve(conn):
        buf = bytearray(64 << 20)
        mv = memoryview(buf)
        while True:
            head = conn.recv(9, socket.MSG_WAITALL)
            if len(head) < 9:
                return
            n = int.from_bytes(head[1:], "little")
            if head[:1] == b"p":  # push: n bytes in, one byte out
                got = 0
                while got < n:
                    got += conn.recv_into(mv[got:n])
                conn.sendall(b"k")
            else:  # pull: n bytes out
                conn.sendall(mv[:n])

    def accept():
        while True:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return host, srv.getsockname()[1]


def _socket_peer(sink: tuple, payload: np.ndarray, into: np.ndarray):
    """A plain TCP connection to the sink and its calls: push ``payload`` (the sink answers
    one byte), pull as many bytes into ``into``. Returns (socket, push, pull)."""
    import socket

    sock = socket.create_connection(tuple(sink))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view, into_view = memoryview(payload).cast("B"), memoryview(into).cast("B")
    head = payload.nbytes

    def push():
        sock.sendall(b"p" + head.to_bytes(8, "little"))
        sock.sendall(view)
        sock.recv(1)

    def pull():
        sock.sendall(b"g" + head.to_bytes(8, "little"))
        got = 0
        while got < head:
            got += sock.recv_into(into_view[got:])

    return sock, push, pull


def _plane_task(server, sink: tuple, seconds: float) -> dict:
    """In a TRAIN worker (where replicas push): MB/s of the plain socket and of ``server``'s
    push (a buffer handed over, as the exchange pushes; a caller's array) and pull."""

    import dask

    n = server.size
    mb = n * 4 / 1e6
    payload = np.full(n, 1e-3, np.float32)
    into = np.empty(n, np.float32)
    sock, sock_push, sock_pull = _socket_peer(sink, payload, into)

    def paced(fn) -> tuple[float, float]:
        """(median, p99) seconds of ``fn`` called every ``PACE`` s for ``seconds``: a replica's
        cadence (a push every ~40 ms) rather than back to back, where ``ack="replay"`` holds
        more than ``adam.ps.replay-bytes`` and push() waits for the forwards (the protocol's
        limit, not the transport's)."""
        for _ in range(3):
            fn()
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            time.sleep(PACE)
        return float(np.median(times)), float(np.percentile(times, 99))

    out: dict = {"mb": mb, "pace_seconds": PACE}
    for name, fn in (("socket_push", sock_push), ("socket_pull", sock_pull)):
        med, p99 = paced(fn)
        out[f"{name}_ms"], out[f"{name}_p99_ms"] = med * 1e3, p99 * 1e3
        out[f"{name}_mb_per_s"] = mb / med
    for mode in ("auto", "tcp", "dask"):
        with dask.config.set({"adam.ps.data-plane": mode}):
            buf = server.buffer()
            buf[:] = 1e-3
            got: dict = {}
            calls = (
                ("push_donated", lambda b=buf: server.push(b)),
                ("push", lambda: server.push(payload)),
                ("pull", lambda: server.pull(out=into)),
            )
            for name, fn in calls:
                med, p99 = paced(fn)
                got[f"{name}_ms"], got[f"{name}_p99_ms"] = med * 1e3, p99 * 1e3
                got[f"{name}_mb_per_s"] = mb / med
            out[mode] = got
            server.release(buf)
            server.settle()
    out["data_plane"] = server.stats()["data_plane"]
    sock.close()
    return out


def _back_to_back(server, sink: tuple, seconds: float) -> dict:
    """From the calling process (a notebook's client), the public API at its defaults: MB/s of
    ``server.push(delta)`` (a caller's array) and ``server.pull(out=)`` called back to back for
    ``seconds`` each, the mean over every call (waits for room in the replay log included),
    against a plain TCP socket moving the same bytes to a PS worker's process, in alternating
    rounds."""

    n = server.size
    mb = n * 4 / 1e6
    delta = np.full(n, 1e-3, np.float32)
    into = np.empty(n, np.float32)
    sock, sock_push, sock_pull = _socket_peer(sink, delta, into)

    def mb_per_s(fn, span: float) -> float:
        for _ in range(3):
            fn()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < span:
            fn()
            calls += 1
        return mb * calls / (time.perf_counter() - t0)

    # ROUNDS rounds, each the socket then ours for a slice of ``seconds``: the machine's drift
    # lands on both; the ratio is the median of the rounds' ratios
    runs: dict[str, list[float]] = {}
    calls = {
        "socket_push": sock_push,
        "push": lambda: server.push(delta),
        "socket_pull": sock_pull,
        "pull": lambda: server.pull(out=into),
    }
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            runs.setdefault(name, []).append(mb_per_s(fn, seconds / ROUNDS))
    out: dict = {f"{k}_mb_per_s": float(np.median(v)) for k, v in runs.items()}
    out["rounds"] = ROUNDS
    for kind in ("push", "pull"):
        ratios = [a / b for a, b in zip(runs[kind], runs[f"socket_{kind}"])]
        out[f"{kind}_vs_socket"] = float(np.median(ratios))
        out[f"{kind}_vs_socket_rounds"] = ratios
    server.settle()
    out["data_plane"] = server.stats()["data_plane"]
    sock.close()
    return out


def bench_plane(seconds: float) -> dict:
    """Push/pull of the MNIST net's delta (1.2 MB, 2 shards) and of 4 MB (4 shards) from a task
    on a TRAIN worker, each mode of ``adam.ps.data-plane``, against a plain TCP socket moving
    the same bytes between that process and a PS worker's."""
    import adam_dask
    from adam_dask.cluster import PS, TRAIN, workers_with_role
    from adam_dask.model import Network
    from adam_dask.ps import ParameterServer

    net = Network.from_spec(adam_dask.config.get("model.spec"), input_shape=(1, 28, 28))
    out: dict = {}
    with adam_dask.cluster.local(ps_nodes=3, data_nodes=0, trainers=1) as client:
        ps = workers_with_role(client, PS)
        train = workers_with_role(client, TRAIN)
        sink = client.run(_start_socket_sink, workers=[ps[0]])[ps[0]]
        for name, size in (("mnist", net.flat.size), ("4mb", N)):
            server = ParameterServer.create(client, size=int(size), shard_bytes=SHARD_BYTES)
            try:
                fut = client.submit(_plane_task, server, sink, seconds, workers=train, pure=False)
                got = fut.result()
                got["client_back_to_back"] = _back_to_back(server, sink, seconds)
            finally:
                server.close()
            out[name] = got
    m = out["mnist"]
    out["push_vs_socket"] = m["auto"]["push_donated_mb_per_s"] / m["socket_push_mb_per_s"]
    out["pull_vs_socket"] = m["auto"]["pull_mb_per_s"] / m["socket_pull_mb_per_s"]
    out["socket_mb_per_s"] = m["socket_push_mb_per_s"]
    out["tcp_push_vs_socket"] = m["tcp"]["push_donated_mb_per_s"] / m["socket_push_mb_per_s"]
    out["tcp_pull_vs_socket"] = m["tcp"]["pull_mb_per_s"] / m["socket_pull_mb_per_s"]
    out["dask_push_vs_socket"] = m["dask"]["push_mb_per_s"] / m["socket_push_mb_per_s"]
    out["dask_pull_vs_socket"] = m["dask"]["pull_mb_per_s"] / m["socket_pull_mb_per_s"]
    f = out["4mb"]
    out["push_4mb_vs_socket"] = f["auto"]["push_donated_mb_per_s"] / f["socket_push_mb_per_s"]
    out["pull_4mb_vs_socket"] = f["auto"]["pull_mb_per_s"] / f["socket_pull_mb_per_s"]
    for name, key in (("mnist", ""), ("4mb", "_4mb")):
        b2b = out[name]["client_back_to_back"]
        out[f"client_push{key}_vs_socket"] = b2b["push_vs_socket"]
        out[f"client_pull{key}_vs_socket"] = b2b["pull_vs_socket"]
    return {"plane": out, **{k: v for k, v in out.items() if "_vs_" in k or k.endswith("_s")}}


# -- training throughput, default ack against ack="primary" ----------------------------------------


def bench_train(acks: list[str], rounds: int, images: int) -> dict:
    import dask
    from _common import mnist_subset_store

    import adam_dask
    from adam_dask.cluster import TRAIN, workers_with_role

    store = mnist_subset_store(images)
    order: list[str] = []
    for r in range(rounds):
        order += acks if r % 2 == 0 else acks[::-1]
    rates: dict[str, list[float]] = {a: [] for a in acks}
    accuracy: dict[str, list[float]] = {a: [] for a in acks}
    out: dict = {"train_images": images, "train_order": order}
    with adam_dask.cluster.local() as client:
        trainers = len(workers_with_role(client, TRAIN))
        # an untimed epoch first: the workers load their kernels and the data servers their
        # cache, so neither lands on the first measured run
        with adam_dask.Trainer(data=store, client=client, progress=False) as trainer:
            trainer.fit(epochs=1)
        for ack in order:
            with dask.config.set({"adam.ps.ack": ack}):
                with adam_dask.Trainer(data=store, client=client, progress=False) as trainer:
                    assert trainer.client is client
                    trainer.fit(epochs=1)
                    assert trainer.server is not None and trainer.server.ack == ack
                    rec = trainer.history.records[-1]
            rates[ack].append(float(rec["images_per_second"]))
            accuracy[ack].append(float(rec["test_accuracy"]))
    default, *others = acks
    mean = {a: sum(v) / len(v) for a, v in rates.items()}
    out.update(
        {
            "train_trainers": trainers,
            "train_images_per_s": mean[default],
            "train_images_per_s_runs": rates[default],
            "train_test_accuracy": accuracy[default],
        }
    )
    for ack in others:
        out[f"{ack}_train_images_per_s"] = mean[ack]
        out[f"{ack}_train_images_per_s_runs"] = rates[ack]
        out[f"{ack}_train_test_accuracy"] = accuracy[ack]
    if "primary" in others:
        out["train_cost_vs_primary"] = 1 - mean[default] / mean["primary"]
    return out


def main() -> None:
    from _common import record

    from adam_dask import config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--seconds",
        type=float,
        default=3.0,
        help="time per rate measurement, and pushes before and after each fault (default 3)",
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="give up waiting for a heal after this"
    )
    p.add_argument(
        "--train-rounds",
        type=int,
        default=2,
        help="pairs of 1-epoch training runs (default ack, ack=primary); 0 skips training",
    )
    p.add_argument(
        "--train-images",
        type=int,
        default=60000,
        help="MNIST training images per epoch (default all 60000; fewer for a smoke run)",
    )
    p.add_argument("--memory-limit", default="1 GiB", help="per worker of the PS cluster")
    p.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    p.add_argument(
        "--plane-only",
        action="store_true",
        help="the apply kernel and the data plane against a socket only (no faults, no training)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)

    default_ack = config.get("ps.ack")
    acks = [default_ack] + (["primary"] if default_ack != "primary" else [])
    load_before = os.getloadavg()[0]
    res: dict = {"ack": default_ack, "seconds": args.seconds}
    res.update(bench_apply(args.seconds))
    res.update(bench_plane(args.seconds))
    if not args.plane_only:
        res.update(bench_cluster(acks, args.seconds, args.timeout, args.memory_limit))
    if args.train_rounds > 0 and not args.plane_only:
        res.update(bench_train(acks, args.train_rounds, args.train_images))
    res["goals"] = {
        "apply_vs_numpy": 0.8,
        "push_vs_raw": 0.8,
        "pull_vs_raw": 0.8,
        "push_vs_socket": 0.8,
        "pull_vs_socket": 0.8,
        "served_seconds": 5.0,
        "healed_seconds": 5.0,
        "lost_max_abs": 0.0,
        "train_cost_vs_primary": 0.10,
    }
    res["load"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    record("ps", res, save=not args.no_save)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
