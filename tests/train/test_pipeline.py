"""The partitions of one replica as threads of one process, joined by sockets (no Dask): the
dataflow trains, every group is pushed once by every partition with its mark, and a broken
link stops the partitions with only complete groups pushed."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from adam_dask.model import Network
from adam_dask.model.partition import plan_partitions
from adam_dask.model.stage import WholeStage, stages_of
from adam_dask.ps.protocol.shard import Mark
from adam_dask.testing import synthetic_digits
from adam_dask.train._groups import minibatches
from adam_dask.train._links import Link
from adam_dask.train._pipeline import PartitionRunner
from adam_dask.train._position import Marker, applied_images

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
WHOLE = "whole"  # the whole model as one WholeStage (the fused step), not a stage of its layers


class RangedStore:
    """An in-process stand-in for the parameter server's ranged calls: one array, every push's
    mark recorded per 'shard' (here one shard per partition span)."""

    def __init__(self, flat: np.ndarray, spans: list[tuple[int, int]]):
        self.flat = flat.copy()
        self.spans = spans
        self.lock = threading.Lock()
        self.marks: dict[int, dict[int, list[Mark]]] = {s: {} for s in range(len(spans))}
        self.outer = 0  # offloaded terms pushed

    def push_range(self, values, start, *, mark=None, out=None):
        with self.lock:
            self.flat[start : start + len(values)] += values
            sid = next(s for s, (a, _) in enumerate(self.spans) if a == start)
            m = (
                Mark(*mark.to_json()[:7], targets=(sid,), synchronous=mark.synchronous)
                if mark is not None
                else None
            )
            self.marks[sid].setdefault(m.replica, []).append(m)
            if out is not None:  # the span after the push
                out[...] = self.flat[start : start + len(values)]
        return out

    def push(self, delta, *, mark=None):
        """A whole model's push (with the offload): its mark as a whole replica's."""
        with self.lock:
            self.flat += delta
            if mark is not None:
                self.marks[0].setdefault(mark.replica, []).append(mark)

    def push_outer(self, offset, errors, activations, scale=1.0, *, mark=None):
        """An offloaded dense layer's terms: the server computes the (out, in) product."""
        with self.lock:
            product = np.float32(scale) * (errors.T @ activations)
            self.flat[offset : offset + product.size] += product.ravel()
            self.outer += 1
            if mark is not None:
                self.marks[0].setdefault(mark.replica, []).append(mark)

    def pull_range(self, start, stop, *, out):
        with self.lock:
            out[...] = self.flat[start:stop]
        return out


def _spans(net, bounds):
    """Each partition's span of the parameters (the stand-in server's shards)."""
    if bounds == WHOLE:
        return [(0, net.flat.size)]
    return [(s.start, s.stop) for s in stages_of(net, bounds)]


def _replica(
    net,
    bounds,
    store,
    feed,
    *,
    break_after=None,
    threads=2,
    momentum=0.0,
    replicas=1,
    replica=0,
    barrier=None,
    offload=(),
):
    stages = [WholeStage(net, offload)] if bounds == WHOLE else stages_of(net, bounds)
    P = len(stages)
    pairs = [socket.socketpair() for _ in range(P - 1)]
    window = plan_partitions(net, P, threads=threads, batch_size=8).window  # the default
    runners = [
        PartitionRunner(
            s,
            k,
            P,
            threads=threads,
            batch_size=8,
            window=window,
            server=store,
            mark=(0, replica, replicas),
            up=Link(pairs[k - 1][1]) if k > 0 else None,
            down=Link(pairs[k][0]) if k < P - 1 else None,
            timeout=30,
            momentum=momentum,
            barrier=barrier,
        )
        for k, s in enumerate(stages)
    ]
    results: dict[int, dict] = {}

    def go(k):
        results[k] = runners[k].run(feed if k == 0 else None)

    ths = [threading.Thread(target=go, args=(k,)) for k in range(P)]
    for th in ths:
        th.start()
    if break_after is not None:
        break_after(runners)
    for th in ths:
        th.join(120)
    return runners, results


class ArrayFeed:
    """Partition 0's feed (a :class:`~adam_dask.train._groups.Feed`) of ``x, y`` as a stream
    of 64-image batches, ``passes`` times, its groups marked by ``marker``."""

    def __init__(self, x, y, marker, *, lr=0.05, passes=1, push_every=128):
        self.x, self.y, self.marker, self.passes = x, y, marker, passes
        self.push_every, self.rate = push_every, lr
        self.cuts: dict[int, int] = {}  # each group's number -> its images, as cut

    def stretches(self):
        return iter(())

    def rest(self):
        for _ in range(self.passes):
            items = (
                (self.x[i : i + 64], self.y[i : i + 64], (0, i // 64))
                for i in range(0, len(self.y), 64)
            )
            yield from minibatches(items, 8)

    def lr(self):
        return self.rate

    def cut(self, counts, images):
        m = self.marker.marks(counts, 1)[0]
        self.marker.commit(m)
        self.cuts[m.seq] = images
        return m.seq, m.covers


@pytest.mark.parametrize(
    ("bounds", "momentum"),
    [
        ([(0, 2), (2, 4)], 0.0),
        ([(0, 1), (1, 3), (3, 4)], 0.0),
        ([(0, 2), (2, 3, 0, 16), (2, 3, 16, 32), (3, 4)], 0.0),  # a dense layer split by neurons
        ([(0, 4)], 0.0),  # every layer, one stage (its layer loops)
        (WHOLE, 0.0),  # the whole model, one stage (the fused step)
        (WHOLE, 0.9),
        ([(0, 2), (2, 3, 0, 16), (2, 3, 16, 32), (3, 4)], 0.9),  # each thread's velocity
    ],
)
def test_a_partitioned_replica_trains_and_pushes_every_group_once_per_partition(bounds, momentum):
    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    x, y = synthetic_digits(1536, seed=0, size=12)
    x = x[:, None].astype(np.float32) / 255
    store = RangedStore(net.flat, _spans(net, bounds))
    before = net.evaluate(x, y)
    marker = Marker(0, 0, 1)
    lr = 0.05 * (1 - momentum)  # the same step once the velocity has built up
    feed = ArrayFeed(x, y, marker, lr=lr, passes=2)
    runners, results = _replica(net, bounds, store, feed, momentum=momentum)
    assert all(r["aborted"] is None for r in results.values())
    assert results[0]["images"] == results[len(results) - 1]["images"] == 2 * len(y)
    # every partition pushed every group, each once
    seqs = [sorted(r["groups_pushed"]) for r in results.values()]
    assert all(s == seqs[0] for s in seqs) and len(set(seqs[0])) == len(seqs[0])
    assert applied_images(store.marks) == 2 * len(y)
    net.flat = store.flat
    after = net.evaluate(x, y)
    # typically 0.98; asynchronous (Hogwild threads, several mini-batches in flight) and on a
    # loaded machine seen as low as 0.36: well above chance (0.1) is what is asserted
    assert after > before + 0.2, (before, after)


class SlowerStore(RangedStore):
    """A parameter server slower than training: each push takes 50 ms."""

    def push_range(self, values, start, *, mark=None, out=None):
        time.sleep(0.05)
        return super().push_range(values, start, mark=mark, out=out)


@pytest.mark.parametrize(("bounds", "replicas"), [(WHOLE, 2), (WHOLE, 1), ([(0, 2), (2, 4)], 2)])
def test_against_a_slow_server_groups_grow_instead_of_waiting_and_damp_the_rate(bounds, replicas):
    """A group closes once it holds push_every images *and* no group waits to be pushed: a
    server slower than training gets fewer, larger groups (every image still pushed once, by
    every partition), and a replica among others (``replicas`` 2) feeds at a rate damped by
    the period it pushed at; one alone does not."""
    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    x, y = synthetic_digits(1536, seed=2, size=12)
    x = x[:, None].astype(np.float32) / 255
    store = SlowerStore(net.flat, _spans(net, bounds))
    feed = ArrayFeed(x, y, Marker(0, 0, replicas), passes=2, push_every=16)
    runners, results = _replica(net, bounds, store, feed, threads=1, replicas=replicas)
    assert all(r["aborted"] is None for r in results.values()), results
    assert applied_images(store.marks) == sum(feed.cuts.values()) == 2 * len(y)
    assert all(sorted(r["groups_pushed"]) == sorted(feed.cuts) for r in results.values())
    assert len(feed.cuts) < 2 * len(y) // 16 // 2  # fewer, larger groups than every 16
    assert max(feed.cuts.values()) > 16
    pace = runners[0].pace
    if replicas > 1:
        assert results[0]["damping"] == pytest.approx((16 + 8) / pace.period)
        assert results[0]["damping"] < 1
    else:
        assert results[0]["damping"] == 1.0


def test_synchronous_replicas_of_one_stage_push_whole_steps_and_end_on_the_same_weights():
    """Synchronous mode through the pipeline (a whole model, one stage, one thread): each
    replica's group is a step of exactly push_every images, pushed (marked synchronous), then
    the barrier, then the pull; the next step waits for it. Two replicas on their own data end
    with every image applied once and with the server's weights, the same for both (after the
    last barrier nothing is pushed), and trained well above chance."""
    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    store = RangedStore(net.flat, [(0, net.flat.size)])
    step = threading.Barrier(2)
    waits = [0, 0]
    feeds, results, runners = [], {}, {}

    def replica(r):
        x, y = synthetic_digits(768, seed=10 + r, size=12)
        x = x[:, None].astype(np.float32) / 255

        def wait():
            waits[r] += 1
            step.wait(60)
            return {"ok": True, "generation": waits[r]}

        feeds.append(feed := ArrayFeed(x, y, Marker(0, r, 2, synchronous=True), push_every=64))
        replica_net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
        rs, res = _replica(
            replica_net, WHOLE, store, feed, threads=1, replicas=2, replica=r, barrier=wait
        )
        runners[r], results[r] = rs[0], res[0]

    x, y = synthetic_digits(768, seed=12, size=12)
    x = x[:, None].astype(np.float32) / 255
    before = net.evaluate(x, y)
    ths = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(120)
    assert all(r["aborted"] is None and r["images"] == 768 for r in results.values()), results
    assert [sorted(f.cuts.values()) for f in feeds] == [[64] * 12] * 2
    assert waits == [12, 12] and [r["pushes"] for r in results.values()] == [12, 12]
    assert applied_images(store.marks) == 2 * 768
    assert all(m.synchronous for per in store.marks.values() for ms in per.values() for m in ms)
    np.testing.assert_array_equal(runners[0].stage.flat, store.flat)
    np.testing.assert_array_equal(runners[1].stage.flat, store.flat)
    net.flat = store.flat
    assert net.evaluate(x, y) > before + 0.2


def test_a_whole_stage_offloads_its_dense_layers_as_terms_the_server_multiplies():
    """The paper's dense-layer offload through the pipeline's whole stage: a group's push is
    the delta without the offloaded weights, then each offloaded layer's (activations, -lr x
    errors), whose product the server applies. The server ends where the replica's own steps
    took its weights (the terms carry the offloaded layer's update exactly, up to float
    rounding), and a replica trained so learns with every image applied once."""
    from adam_dask.model.partition import profitable_offload
    from adam_dask.train._stage_exchange import StageExchange

    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    layers = profitable_offload(net, 16)
    assert layers == ["2"]  # fc32: 16 x (96 + 32) floats of terms < its 96 x 32 weights
    stage = WholeStage(net, layers)
    store = RangedStore(net.flat, _spans(net, WHOLE))
    errors: list = []
    left: list = []  # a group left the exchange: pushed and installed
    exchange = StageExchange(
        stage,
        store,
        part=(0, 1),
        threads=1,
        mark=(0, 0, 1),
        dropped=lambda: False,
        on_error=errors.append,
        on_left=lambda: left.append(1),
    )
    x, y = synthetic_digits(64, seed=3, size=12)
    x = x[:, None].astype(np.float32) / 255
    ctx = stage.context(8)
    for g in range(2):
        for a in range(0, 32, 8):
            terms = {}
            stage.step(ctx, x[a:], y[a:], 8, 0.1, exchange.acc(0, g), terms=terms)
            exchange.record_terms(0, g, terms)
        mine = stage.flat.copy()  # the replica's weights after its steps
        exchange.take(g, g + 1, [], 32)
        deadline = time.monotonic() + 30
        while len(left) < g + 1 and not errors:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not errors, errors
        np.testing.assert_allclose(store.flat, mine, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stage.flat, mine, rtol=1e-5, atol=1e-6)  # installed
    exchange.close()
    assert store.outer == 2

    x, y = synthetic_digits(1536, seed=3, size=12)
    x = x[:, None].astype(np.float32) / 255
    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    store = RangedStore(net.flat, _spans(net, WHOLE))
    feed = ArrayFeed(x, y, Marker(0, 0, 1), push_every=16)
    _, results = _replica(net, WHOLE, store, feed, threads=2, offload=layers)
    assert results[0]["aborted"] is None and results[0]["images"] == len(y)
    assert applied_images(store.marks) == len(y) and store.outer == len(feed.cuts)
    net.flat = store.flat
    assert net.evaluate(x, y) > 0.5


def test_a_broken_link_stops_every_partition_with_only_whole_groups_pushed():
    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    x, y = synthetic_digits(1536, seed=1, size=12)
    x = x[:, None].astype(np.float32) / 255
    bounds = [(0, 1), (1, 3), (3, 4)]
    store = RangedStore(net.flat, _spans(net, bounds))
    marker = Marker(0, 0, 1)

    def cut(runners):
        import time

        deadline = time.monotonic() + 60
        while min(r.exchange.pushes for r in runners) < 2:  # every partition pushed two groups
            assert all(r.error is None for r in runners), [r.error for r in runners]
            assert time.monotonic() < deadline, [r.exchange.pushes for r in runners]
            time.sleep(0.01)
        runners[1].down.sock.shutdown(socket.SHUT_RDWR)  # the link 1 -> 2 breaks

    feed = ArrayFeed(x, y, marker, passes=3)
    runners, results = _replica(net, bounds, store, feed, break_after=cut)
    assert all(r["aborted"] for r in results.values()), results
    # a group counts only when every partition's part of it was pushed
    full = set.intersection(*(set(r["groups_pushed"]) for r in results.values()))
    assert applied_images(store.marks) == sum(feed.cuts[seq] for seq in full)
    assert len(full) >= 2


def test_an_event_poll_asks_at_most_every_interval_and_stays_set():
    from adam_dask.train.task import EventPoll

    class Event:
        asks, value = 0, False

        def is_set(self):
            self.asks += 1
            return self.value

    ev = Event()
    poll = EventPoll(ev, interval=60.0)
    assert not poll.is_set() and not poll.is_set()
    assert ev.asks == 1  # the second ask came within the interval
    ev.value = True
    poll._next = 0.0  # the interval has passed
    assert poll.is_set()
    ev.value = False
    poll._next = 0.0
    assert poll.is_set() and ev.asks == 2  # once set, never asked again


@pytest.mark.parametrize("threads", [1, 2])
def test_takes_and_installs_under_concurrent_updates_push_every_update_exactly_once(threads):
    """A training thread adds integer updates (exact in float32) to the weights and its
    accumulator while the exchange thread pushes each taken group and installs the pulled
    span (summed aside, one pass over the weights) after every push: the server ends with
    every update exactly once, and an install once all is quiet is exactly the server's
    values plus the group still open."""
    net = Network.from_spec(SPEC, input_shape=(1, 12, 12), seed=0)
    stage = stages_of(net, [(0, 2), (2, 4)])[1]
    stage.flat[...] = np.round(stage.flat * 100)  # integers: every sum below is exact
    start, stop = stage.start, stage.stop
    store = RangedStore(net.flat, [(0, start), (start, stop)])
    store.flat[start:stop] = stage.flat
    runner = PartitionRunner(
        stage, 1, 2, threads=threads, batch_size=8, window=4, server=store, mark=(0, 0, 1)
    )
    rng = np.random.default_rng(0)
    total = np.zeros(stage.size, np.float32)
    flat = stage.flat
    groups, per_group = 40, 3
    for g in range(groups + 1):  # the last group stays open
        info = {"g": g, "seq": g + 1, "gn": per_group, "covers": [], "images": 8 * per_group}
        for k in range(per_group):
            u = rng.integers(-3, 4, stage.size).astype(np.float32)
            acc = runner.exchange.acc(k % threads, g)
            flat += u  # a Hogwild write, racing the installs' copies
            acc += u
            total += u
            if g < groups:
                runner._applied(info)
    runner.exchange.close()
    assert runner.error is None and runner.exchange.pushes == groups
    open_group = np.zeros(stage.size, np.float32)
    for pair in runner.exchange._accs:
        open_group += pair[groups % 2]
    initial = np.round(net.flat[start:stop] * 100)
    np.testing.assert_array_equal(store.flat[start:stop], initial + total - open_group)
    pulled = np.empty(stage.size, np.float32)
    store.pull_range(start, stop, out=pulled)
    runner.exchange.install(pulled)
    np.testing.assert_array_equal(flat, store.flat[start:stop] + open_group)


@pytest.mark.parametrize("size", [64, 1 << 18])
def test_a_link_delivers_every_message_whole_and_in_order(size):
    """Headers with payloads from none to larger than the socket's buffers, sent by two
    threads at once (each message in one gathered send), read through the link's buffer
    (small reads served from it, large ones straight into the array)."""
    from adam_dask.train._links import _Stream

    a, b = socket.socketpair()
    send, recv = Link(a), Link(b)
    recv._stream = _Stream(b, size)
    rng = np.random.default_rng(0)
    sizes = [0, 1, 7, 15, 16, 17, 100, 5000, 300_000, *rng.integers(0, 70_000, 60).tolist()]
    msgs = [(k, np.arange(n, dtype=np.float32) + k) for k, n in enumerate(sizes)]

    def sender(part):
        for k, x in part:
            if len(x):
                send.send({"op": "x", "k": k, "n": len(x), "t": "h" * (k % 5)}, x)
            else:
                send.send({"op": "x", "k": k, "n": 0, "t": "h" * (k % 5)})

    ths = [threading.Thread(target=sender, args=(msgs[i::2],)) for i in range(2)]
    for th in ths:
        th.start()
    got = {}
    for _ in msgs:
        header, x = recv.recv(lambda h: (h["n"],) if h["n"] else None)
        assert header["t"] == "h" * (header["k"] % 5)
        got[header["k"]] = x
    for th in ths:
        th.join()
    for k, x in msgs:
        if len(x):
            np.testing.assert_array_equal(got[k], x)
        else:
            assert got[k] is None
    assert send.bytes_sent == sum(x.nbytes for _, x in msgs)
    send.close()
    with pytest.raises((OSError, ValueError)):
        recv.recv(lambda h: None)
    recv.close()


def test_a_gathered_send_cut_short_by_the_kernel_goes_on_where_it_stopped():
    """The framing sends a message in one ``sendmsg``; one the kernel takes in part goes on
    from the byte where it stopped, the message whole and in order."""
    from adam_dask.net.framing import recv_msg, send_msg

    class Sock:  # sends at most 5 bytes a call, as a socket with a timeout or a signal may
        data = bytearray()

        def sendmsg(self, buffers):
            chunk = b"".join(bytes(b) for b in buffers)[:5]
            self.data += chunk
            return len(chunk)

    sock = Sock()
    values = np.arange(10, dtype=np.float32)
    send_msg(sock, {"op": "x", "n": 10}, values, b"!")  # type: ignore[arg-type]
    a, b = socket.socketpair()
    a.sendall(bytes(sock.data))
    assert recv_msg(b) == {"op": "x", "n": 10}
    rest = b.recv(100)
    assert rest == values.tobytes() + b"!"
    a.close()
    b.close()


def test_a_replica_feed_gives_the_rest_of_its_share_slowed_marked_and_reported(monkeypatch):
    """Partition 0's feed of a replica with no marks yet (no stretch to re-train): the rest of
    its share from the data service in mini-batches, a slow replica's sleep once per stream
    batch, each group cut numbered in order with the images it covers and reported as the
    replica's progress, the rate the schedule's at that progress; closing it closes the
    stream and hands back its figures."""
    from types import SimpleNamespace

    from adam_dask.train import _groups

    class Stream:
        closed = False

        def __iter__(self):
            x, y = np.zeros((64, 1, 4, 4), np.float32), np.zeros(64, np.int64)
            return iter([(x, y, (0, b)) for b in range(4)])

        def stats(self):
            return {"stall_fraction": 0.25, "wait_seconds": 1.5}

        def close(self):
            self.closed = True

    stream = Stream()
    asked = []

    class Data:
        def stream(self, *args, **kwargs):
            asked.append((args, kwargs))
            return stream

    class Server:
        def marks(self, epoch):
            return {}

    job = SimpleNamespace(
        replica=1,
        replicas=2,
        epoch=3,
        share_images=256,
        delay=0.5,
        settings=SimpleNamespace(batch_size=16, push_every=128),
        schedule=SimpleNamespace(at=lambda epochs: round(epochs, 3)),
    )
    slept, reports = [], []
    monkeypatch.setattr(_groups.time, "sleep", slept.append)
    feed = _groups.ReplicaFeed(job, Server(), Data(), reports.append)
    assert list(feed.stretches()) == [] and feed.push_every == 128
    assert feed.lr() == 3.0  # the share's start
    batches = list(feed.rest())
    assert [len(y) for _, y, _ in batches] == [16] * 16 and slept == [0.5] * 4
    assert asked == [((1, 2, 3), {"return_key": True, "resume": {}})]
    assert [feed.cut({(0, 0): 64, (0, 1): 64}, 128)[0], feed.cut({(0, 2): 64}, 64)[0]] == [0, 1]
    assert reports == [128, 192] and feed.lr() == 3.75  # 192 of 256 images
    assert feed.close() == {"stall_fraction": 0.25, "wait_seconds": 1.5} and stream.closed
