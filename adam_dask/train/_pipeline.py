"""One stage of a replica at work, the one way a replica trains (the whole model, or a partition
of it: paper 3.2, Figure 6): its Hogwild threads, its messages to and from its neighbours, its
push groups and its exchange with the parameter server. No Dask: the task (``_partition_task``)
connects the sockets (:mod:`._links`), cuts partition 0's groups (:mod:`._groups`) and gives it
a parameter-server handle; tests run the partitions of a replica as threads of one process.

**Dataflow.** Partition 0 draws mini-batches (from its :class:`~._groups.Feed`) and runs its
layers forward; each partition sends its output activations to the next over a long-lived
socket (a :class:`~._links.Link`); the last partition computes the loss and its error terms and
the errors travel back the same way. Each partition's ``threads`` threads take
whatever work is ready (errors coming back first), so several mini-batches are in flight in
every partition at once (at most ``window`` in the replica) and the partitions overlap instead
of waiting for one another. A partition keeps a mini-batch's activations (its
:class:`~adam_dask.model.stage.StageContext`) until its errors come back; its weights are
updated lock-free by its threads (Hogwild) as each backward pass ends.

**Staleness.** An image's backward pass in partition ``p`` uses ``p``'s weights as they are
when its errors arrive, not those its forward pass used: updates of the other mini-batches in
flight (at most ``window - 1``) and of pulls in between have landed. PipeDream's weight
stashing keeps the forward's weights for the backward; we do not (see docs/design.md).

**Push groups.** Partition 0 cuts what it feeds into groups and numbers them: a re-trained
stretch is one group; the rest closes a group once it holds ``push_every`` images and partition
0 has no group waiting to be pushed, so a busy parameter server gets fewer, larger pushes and
the replica never waits for it (the paper's accumulate-then-push), its rate damped for
the longer period among other replicas (a :class:`~adam_dask.train.streams.PushPace`). A
group's last mini-batch carries what the group is (its size, number and cover). Every
partition pushes its update of a group as part ``p`` of that group's push (one
:class:`~adam_dask.ps.protocol.shard.Mark`: the group's number, the images it covers, ``parts =
P``) to the shards of its own span and reads its span back in the same round trip
(:meth:`ParameterServer.push_range` with ``out``). A
push of a group holds exactly that group's mini-batches: each thread accumulates into one of
two buffers by the group's parity, and partition 0 does not start group ``g + 2`` before group
``g`` came back from every partition (each partition takes group ``g``'s buffers when it
applied the group's last mini-batch, before that mini-batch's errors leave it), so at most two
groups are open.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AdamError
from ..model.stage import Stage, StageContext, WholeStage
from ._groups import Feed
from ._links import Link
from ._stage_exchange import StageExchange
from .streams import PushPace

if TYPE_CHECKING:
    from ._handle import StagePushes

__all__ = ["PartitionRunner"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Open:
    """A group open in this partition; what it is (its mini-batches ``size``, ``seq``,
    ``covers``, ``images``) arrives with its last mini-batch."""

    ordinal: int
    seq: int = -1
    size: int | None = None
    covers: list = field(default_factory=list)
    images: int = 0
    applied: int = 0
    stretch: bool = False  # a re-trained stretch (pushed alone, in sync mode too)


class PartitionRunner:
    """Partition ``index`` of ``parts`` of one replica, training ``stage``.

    ``up`` / ``down``: the :class:`Link` to the previous / next partition (None at the ends).
    ``server``: the span's pushes and pulls (:class:`~adam_dask.train._handle.StagePushes`).
    ``mark``: ``(epoch, replica, replicas)`` of the pushes' marks. ``stop``: a flag
    (``is_set()``) partition 0 polls between groups (the epoch's quorum); ``abort``: one every
    partition polls (the replica is being re-run). ``timeout``: seconds without a
    message from a neighbour while it owes one, after which the partition gives up (a frozen
    neighbour).
    """

    def __init__(
        self,
        stage: Stage | WholeStage,
        index: int,
        parts: int,
        *,
        threads: int,
        batch_size: int,
        window: int,
        server: StagePushes,
        mark: tuple[int, int, int],
        up: Link | None = None,
        down: Link | None = None,
        stop: Any = None,
        abort: Any = None,
        timeout: float = 60.0,
        momentum: float = 0.0,
        barrier: Callable[[], dict] | None = None,
    ):
        self.stage, self.index, self.parts = stage, int(index), int(parts)
        self.first, self.last = self.index == 0, self.index == self.parts - 1
        self.threads, self.window = int(threads), max(1, int(window))
        self.mark = mark
        self.up, self.down = up, down
        self.stop_flag, self.abort_flag = stop, abort
        self.timeout = float(timeout)
        n = stage.size
        # with momentum, each thread's velocity over the stage
        m = float(momentum)
        self._steps: list[dict[str, Any]] = [
            {"velocity": np.zeros(n, np.float32), "momentum": m} if m > 0 else {}
            for _ in range(self.threads)
        ]
        # a mini-batch's work buffers, kept until its errors come back; a whole model as one
        # stage (a WholeStage, either engine) runs the fused step (the engine's) in a
        # context per thread
        self._contexts: queue.Queue[Any] = queue.Queue()
        for _ in range(self.window if not self.last else self.threads):
            self._contexts.put(stage.context(batch_size))
        self._work: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._groups: dict[int, _Open] = {}
        self._pending: dict[int, tuple[StageContext, dict]] = {}
        self.error: BaseException | None = None
        self.failed: str | None = None
        self._done = threading.Event()
        self._heard = time.monotonic()
        # partition 0's window and group gate
        self._cond = threading.Condition()
        self._in_flight = 0
        self._completed: dict[int, int] = {}  # group ordinal -> mini-batches back
        self._sizes: dict[int, int] = {}
        self._unsent = 0  # groups closed by the feed and not pushed (or dropped) yet
        self._mb = 0  # the next mini-batch's number
        self.batch_size = int(batch_size)
        self.pace: PushPace | None = None  # partition 0's push period and damping
        self.lr_end = 0.0  # partition 0: the rate of its last group
        self.sync = barrier is not None  # each group a synchronous step
        # counts
        self.images = 0
        self.loss_sum = 0.0
        self.exchange = StageExchange(
            stage,
            server,
            part=(self.index, self.parts),
            threads=self.threads,
            mark=mark,
            dropped=lambda: (
                self.error is not None or (self.abort_flag is not None and self.abort_flag.is_set())
            ),
            on_error=lambda exc: self._fail(f"partition {self.index}: push failed ({exc!r})", exc),
            on_left=self._left,
            barrier=barrier,
            label=f"replica {mark[1]} in epoch {mark[0]}",
        )

    def run(self, feed: Feed | None = None) -> dict:
        """Train until partition 0's ``feed`` is done (partition 0) or the end arrives from
        upstream; returns the partition's statistics (``aborted`` with the reason when a
        neighbour was lost or the replica aborted: the complete groups taken before that are
        pushed, nothing else)."""
        t0 = time.perf_counter()
        threads = [
            self._thread(self._train, f"partition-{self.index}-{t}", t) for t in range(self.threads)
        ]
        if self.up is not None:
            threads.append(self._thread(self._receive, "from-up", self.up, "up"))
        if self.down is not None:
            threads.append(self._thread(self._receive, "from-down", self.down, "down"))
        for th in threads:
            th.start()
        try:
            if self.first:
                assert feed is not None
                self._feed(feed)
            else:
                while not self._done.wait(0.25):
                    self._watch()
        except BaseException as exc:
            self._fail(f"partition {self.index}: {exc!r}", exc)
        # stop the threads (their work is done, or abandoned)
        for _ in range(self.threads):
            self._work.put((-1, next(self._order), None))
        for th in threads[: self.threads]:
            th.join()
        if self.failed is None and self.down is not None:
            self.down.send({"op": "end"})
        self.exchange.close()
        for link in (self.up, self.down):
            if link is not None:
                link.close()
        if isinstance(self.error, AdamError):  # a diverged model, a sync step timed out
            raise self.error
        return {
            "partition": self.index,
            "images": self.images,
            "loss_sum": self.loss_sum,
            "pushes": self.exchange.pushes,
            "images_pushed": self.exchange.images_pushed,
            "groups_pushed": list(self.exchange.groups_pushed),
            "ps_seconds": self.exchange.ps_seconds,
            "seconds": time.perf_counter() - t0,
            "bytes_sent": sum(lk.bytes_sent for lk in (self.up, self.down) if lk is not None),
            "aborted": self.failed,
            "damping": self.pace.damping if self.pace is not None else 1.0,
        }

    def _thread(self, fn: Callable, name: str, *args: Any) -> threading.Thread:
        return threading.Thread(
            target=contextvars.copy_context().run, args=(fn, *args), name=name, daemon=True
        )

    def _watch(self) -> None:
        if self.abort_flag is not None and self.abort_flag.is_set():
            self._fail("the replica is being re-run")
        # owed: errors for the mini-batches sent on; and to a partition after the first,
        # the next message (partition 0 sends every mini-batch and, at the end, the end)
        owed = self._pending or not self.first
        if owed and time.monotonic() - self._heard > self.timeout:
            self._fail(
                f"a neighbour of partition {self.index} sent nothing for {self.timeout:.0f} s"
            )

    def _fail(self, reason: str, exc: BaseException | None = None) -> None:
        with self._lock:
            if self.failed is not None:
                return
            self.failed = reason
            if exc is not None and self.error is None:
                self.error = exc
        logger.warning("partition %d of replica %d stops: %s", self.index, self.mark[1], reason)
        self._done.set()
        with self._cond:
            self._cond.notify_all()
        for link in (self.up, self.down):  # the neighbours notice at once
            if link is not None:
                try:
                    link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    # -- partition 0: feeding the replica -------------------------------------------------

    def _feed(self, feed: Feed) -> None:
        replicas = self.mark[2]  # among others, the rate is damped for a longer push period
        slack = self.threads * self.batch_size
        self.pace = PushPace(feed.push_every, slack=slack, damp=replicas > 1 and not self.sync)
        self.lr_end = feed.lr()
        self._feed_groups(feed)
        with self._cond:  # every mini-batch back from every partition
            while self.failed is None and self._in_flight > 0:
                self._wait_cond()
        self._done.set()

    def _feed_groups(self, feed: Feed) -> None:
        """Feed the replica: ``feed``'s fixed groups, then its rest cut into groups as they
        go, each closing once it holds ``feed.push_every`` images and no group of this
        partition waits to be pushed (accumulate-then-push: see the module), the rate damped
        for the period it pushes at (``pace``). Stops between groups once the stop is set."""
        assert self.pace is not None
        g = 0
        for group in feed.stretches():
            if not self._open(g):
                return
            n = len(group.batches)
            close = {
                "gn": n,
                "seq": group.seq,
                "covers": group.covers,
                "images": group.images,
                "stretch": True,
            }
            self.lr_end = group.lr
            for i, (x, y) in enumerate(group.batches):
                if not self._put(g, group.lr, x, y, close if i == n - 1 else None):
                    return
            g += 1
        opened = self._open(g)  # before the rest's stream opens: not after a stop
        if not opened:
            return
        rest = iter(feed.rest())
        ahead = next(rest, None)
        while ahead is not None:
            if not opened and not self._open(g):
                return
            opened = False
            lr = self.lr_end = feed.lr() * self.pace.damping
            counts: dict = {}
            images = batches = 0
            while ahead is not None:
                x, y, key = ahead
                ahead = next(rest, None)
                counts[key] = counts.get(key, 0) + len(y)
                images += len(y)
                batches += 1
                last: dict | None = None
                if ahead is None or (images >= feed.push_every and self._unsent == 0):
                    seq, covers = feed.cut(counts, images)
                    last = {"gn": batches, "seq": seq, "covers": covers, "images": images}
                    self.pace.pushed(images)
                if not self._put(g, lr, x, y, last):
                    return
                if last is not None:
                    break
            g += 1

    def _open(self, g: int) -> bool:
        """Whether group ``g`` may open (nothing failed, no stop): at most two groups are open,
        so it waits for group ``g - 2`` to come back; a synchronous step waits for the last
        one's push, barrier and pull (every replica starts each step from the same weights)."""
        if self.failed is not None or (self.stop_flag is not None and self.stop_flag.is_set()):
            return False
        with self._cond:
            while self.sync and self.failed is None and self._unsent > 0:
                self._wait_cond()
            while (
                g >= 2
                and self.failed is None
                and self._completed.get(g - 2, 0) < self._sizes[g - 2]
            ):
                self._wait_cond()
        return self.failed is None

    def _put(self, g: int, lr: float, x: np.ndarray, y: np.ndarray, close: dict | None) -> bool:
        """Send mini-batch ``(x, y)`` of group ``g`` into the replica (once fewer than
        ``window`` are in flight); ``close``: it is the group's last, and what the group is
        (its mini-batches ``gn``, number ``seq``, ``covers``, ``images``). False once the
        replica failed."""
        info: dict[str, Any] = {"g": g, "lr": lr}
        if close is not None:
            info.update(close)
        with self._cond:
            while self.failed is None and self._in_flight >= self.window:
                self._wait_cond()
            if self.failed is not None:
                return False
            self._in_flight += 1
            if close is not None:
                self._sizes[g] = int(close["gn"])
                self._unsent += 1
        self._work.put((1, next(self._order), ("f", self._mb, info, x, y)))
        self._mb += 1
        return True

    def _wait_cond(self) -> None:
        self._cond.wait(0.25)
        self._cond.release()
        try:
            self._watch()
        finally:
            self._cond.acquire()

    def _back(self, g: int) -> None:
        """A mini-batch of group ``g`` came back to partition 0: every partition applied it."""
        with self._cond:
            self._in_flight -= 1
            self._completed[g] = self._completed.get(g, 0) + 1
            self._cond.notify_all()

    # -- receiving ----------------------------------------------------------------------------

    def _receive(self, link: Link, side: str) -> None:
        stage = self.stage
        assert isinstance(stage, Stage)  # partitions have neighbours, a whole stage none

        def shape_of(h: dict) -> tuple[int, ...] | None:
            if h["op"] == "f":
                return (int(h["n"]), *stage.in_shape)
            if h["op"] == "b":
                return (int(h["n"]), *stage.out_shape)
            return None

        try:
            while True:
                header, values = link.recv(shape_of)
                self._heard = time.monotonic()
                op = header["op"]
                if op == "f":
                    y = np.frombuffer(header["y"], np.int64)
                    self._work.put((1, next(self._order), ("f", header["mb"], header, values, y)))
                elif op == "b":
                    self._work.put((0, next(self._order), ("b", header["mb"], None, values, None)))
                elif op == "end":
                    self._done.set()
                    return
        except (OSError, ValueError) as exc:
            if not self._done.is_set():  # after the end, a neighbour closing is no news
                self._fail(f"the link {side} broke ({exc!r})")

    # -- the stage's threads --------------------------------------------------------------------

    def _train(self, t: int) -> None:
        stage = self.stage
        try:
            while True:
                _, _, task = self._work.get()
                if task is None or self.failed is not None:
                    return
                kind, mb, info, values, y = task
                if kind == "f":
                    ctx = self._contexts.get()
                    n = len(values)
                    if self.last:
                        loss = self._last_step(t, ctx, values, y, n, info)
                        with self._lock:
                            self.images += n
                            self.loss_sum += loss * n
                        self._applied(info)
                        if self.first:  # the whole model, one stage: the mini-batch is back
                            self._back(info["g"])
                        else:
                            assert self.up is not None
                            self.up.send({"op": "b", "mb": mb, "n": n}, ctx.din[:n])
                        self._contexts.put(ctx)
                    else:
                        assert isinstance(stage, Stage)
                        out = stage.forward_into(ctx, values, n)
                        with self._lock:
                            self._pending[mb] = (ctx, info)
                        header = dict(info)
                        header.update(
                            op="f", mb=mb, n=n, y=np.ascontiguousarray(y, np.int64).tobytes()
                        )
                        assert self.down is not None
                        self.down.send(header, out)
                else:
                    with self._lock:
                        ctx, info = self._pending.pop(mb)
                    n = len(values)
                    acc = self.exchange.acc(t, info["g"])
                    assert isinstance(stage, Stage)  # errors come back to a partition
                    stage.backward_update(ctx, n, info["lr"], acc, dout=values, **self._steps[t])
                    if self.first:
                        with self._lock:
                            self.images += n
                    self._applied(info)
                    if self.first:
                        self._back(info["g"])
                    else:
                        assert self.up is not None
                        self.up.send({"op": "b", "mb": mb, "n": n}, ctx.din[:n])
                    self._contexts.put(ctx)
        except BaseException as exc:
            self._fail(f"partition {self.index}: {exc!r}", exc)

    def _last_step(self, t: int, ctx: Any, x: np.ndarray, y: np.ndarray, n: int, info: dict):
        """The last stage's forward, loss, backward and update of a mini-batch, by thread
        ``t``; a whole model as one stage runs the fused step (one numba call). The loss."""
        acc, lr = self.exchange.acc(t, info["g"]), info["lr"]
        stage = self.stage
        if isinstance(stage, WholeStage):
            if not stage.offload:
                return stage.step(ctx, x, y, n, lr, acc, **self._steps[t])
            terms: dict = {}
            loss = stage.step(ctx, x, y, n, lr, acc, terms=terms, **self._steps[t])
            self.exchange.record_terms(t, info["g"], terms)
            return loss
        stage.forward_into(ctx, x, n)
        return stage.backward_update(ctx, n, lr, acc, labels=y, **self._steps[t])

    def _applied(self, info: dict) -> None:
        """A mini-batch of group ``info["g"]`` was applied here; the last one takes the group
        (before its errors leave this partition)."""
        g = info["g"]
        with self._lock:
            grp = self._groups.get(g)
            if grp is None:
                grp = self._groups[g] = _Open(g)
            grp.applied += 1
            if "gn" in info:  # the group's last mini-batch (not always the last applied)
                grp.size, grp.seq, grp.covers = int(info["gn"]), info["seq"], info["covers"]
                grp.images, grp.stretch = int(info["images"]), bool(info.get("stretch"))
            complete = grp.applied == grp.size
            if complete:
                del self._groups[g]
        if complete:
            self.exchange.take(g, grp.seq, grp.covers, grp.images, stretch=grp.stretch)

    def _left(self) -> None:
        """A group taken here left the exchange (pushed or dropped): partition 0's feed may
        close the next one."""
        if self.first:
            with self._cond:
                self._unsent -= 1
