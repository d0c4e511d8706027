"""One partition of a partitioned model replica at work (paper 3.2, Figure 6): its stage's
Hogwild threads, the messages to and from its neighbour partitions, its push groups' accounting
and its exchange with the parameter server. No Dask: the task (``_partition_task.py``)
connects the sockets (:mod:`._links`), cuts partition 0's groups (:mod:`._groups`) and gives it
a parameter-server handle; tests run the partitions of a replica as threads of one process.

**Dataflow.** Partition 0 draws mini-batches (from its push groups, :class:`~._groups.Group`)
and runs its layers forward; each partition sends its output activations to the next over a
long-lived socket (a :class:`~._links.Link`); the last partition computes the loss and its
error terms and the errors travel back the same way. Each partition's ``threads`` threads take
whatever work is ready (errors coming back first), so several mini-batches are in flight in
every partition at once (at most ``window`` in the replica) and the partitions overlap instead
of waiting for one another. A partition keeps a mini-batch's activations (its
:class:`~adam_dask.model.stage.StageContext`) until its errors come back; its weights are
updated lock-free by its threads (Hogwild) as each backward pass ends.

**Staleness.** An image's backward pass in partition ``p`` uses ``p``'s weights as they are
when its errors arrive, not those its forward pass used: updates of the other mini-batches in
flight (at most ``window - 1``) and of pulls in between have landed. PipeDream's weight
stashing keeps the forward's weights for the backward; we do not (see docs/design.md).

**Push groups.** Partition 0 cuts the stream into groups of about ``push_every`` images (a
re-trained stretch is one group) and numbers them; every partition pushes its update of a
group as part ``p`` of that group's push (one :class:`~adam_dask.ps.protocol.shard.Mark`: the group's
number, the images it covers, ``parts = P``) to the shards of its own span
and reads its span back in the same round trip (:meth:`ParameterServer.push_range` with ``out``), as a
whole replica pushes with its pull. A push of a group holds exactly that
group's mini-batches: each thread accumulates into one of two buffers by the group's parity,
and partition 0 does not start group ``g + 2`` before group ``g`` came back from every
partition (each partition takes group ``g``'s buffers when it applied the group's last
mini-batch, before that mini-batch's errors leave it), so at most two groups are open.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..model.stage import Stage, StageContext
from ..ps.protocol.shard import Mark
from ._communicator import Communicator
from ._groups import Group
from ._links import Link
from ._updates import summed

if TYPE_CHECKING:
    from ._handle import RangedPushes

__all__ = ["PartitionRunner"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Open:
    """A group open in this partition."""

    ordinal: int
    seq: int
    size: int  # mini-batches
    covers: list
    images: int = 0
    applied: int = 0


class PartitionRunner:
    """Partition ``index`` of ``parts`` of one replica, training ``stage``.

    ``up`` / ``down``: the :class:`Link` to the previous / next partition (None at the ends).
    ``server``: the span's pushes and pulls (:class:`~adam_dask.train._handle.RangedPushes`).
    ``mark``: ``(epoch, replica, replicas)`` of the pushes' marks. ``stop``: a flag
    (``is_set()``) partition 0 polls between groups (the epoch's quorum); ``abort``: one every
    partition polls (the replica is being re-run). ``timeout``: seconds without a
    message from a neighbour while it owes one, after which the partition gives up (a frozen
    neighbour).
    """

    def __init__(
        self,
        stage: Stage,
        index: int,
        parts: int,
        *,
        threads: int,
        batch_size: int,
        window: int,
        server: RangedPushes,
        mark: tuple[int, int, int],
        up: Link | None = None,
        down: Link | None = None,
        stop: Any = None,
        abort: Any = None,
        timeout: float = 60.0,
        momentum: float = 0.0,
    ):
        self.stage, self.index, self.parts = stage, int(index), int(parts)
        self.first, self.last = self.index == 0, self.index == self.parts - 1
        self.threads, self.window = int(threads), max(1, int(window))
        self.server, self.mark = server, mark
        self.up, self.down = up, down
        self.stop_flag, self.abort_flag = stop, abort
        self.timeout = float(timeout)
        n = stage.size
        # accumulators: one per thread and group parity, and whether each may hold updates
        # (an install adds only those)
        self._accs = [[np.zeros(n, np.float32) for _ in range(2)] for _ in range(self.threads)]
        # with momentum, each thread's velocity over the stage (as a whole replica's threads)
        m = float(momentum)
        self._steps: list[dict[str, Any]] = [
            {"velocity": np.zeros(n, np.float32), "momentum": m} if m > 0 else {}
            for _ in range(self.threads)
        ]
        self._touched = [[False, False] for _ in range(self.threads)]
        # zeroed buffers: a take swaps one in for thread 0's accumulator, which is pushed
        self._buffers: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(2):
            self._buffers.put(np.zeros(n, np.float32))
        self._pulled = np.zeros(n, np.float32)  # the span read back with each push
        # a mini-batch's work buffers, kept until its errors come back; a whole model as one
        # stage runs the fused step (a whole replica's) in a context per thread
        self._fused = stage.whole is not None
        self._contexts: queue.Queue[Any] = queue.Queue()
        for _ in range(self.window if not self.last else self.threads):
            self._contexts.put(
                stage.fused_context(batch_size) if self._fused else stage.context(batch_size)
            )
        self._work: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._take_lock = threading.Lock()
        self._groups: dict[int, _Open] = {}
        self._pending: dict[int, tuple[StageContext, dict]] = {}
        self._unpushed: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.failed: str | None = None
        self._done = threading.Event()
        self._heard = time.monotonic()
        # partition 0's window and group gate
        self._cond = threading.Condition()
        self._in_flight = 0
        self._completed: dict[int, int] = {}  # group ordinal -> mini-batches back
        self._sizes: dict[int, int] = {}
        # counts
        self.images = 0
        self.loss_sum = 0.0
        self.pushes = 0
        self.images_pushed = 0
        self.ps_seconds = 0.0
        self.groups_pushed: list[int] = []
        self._communicator: Communicator[tuple[_Open, np.ndarray]] = Communicator(
            self._send,
            name=f"partition-{self.index}-exchange",
            on_error=lambda exc: self._fail(f"partition {self.index}: push failed ({exc!r})", exc),
            drop=self._drop,
        )

    # -- running ----------------------------------------------------------------------------

    def run(self, groups: Iterable[Group] | None = None) -> dict:
        """Train until partition 0's ``groups`` are done (partition 0) or the end arrives from
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
                assert groups is not None
                self._feed(groups)
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
        self._communicator.close()
        for link in (self.up, self.down):
            if link is not None:
                link.close()
        if self.error is not None and self.failed is None:
            raise self.error
        return {
            "partition": self.index,
            "images": self.images,
            "loss_sum": self.loss_sum,
            "pushes": self.pushes,
            "images_pushed": self.images_pushed,
            "groups_pushed": list(self.groups_pushed),
            "ps_seconds": self.ps_seconds,
            "seconds": time.perf_counter() - t0,
            "bytes_sent": sum(lk.bytes_sent for lk in (self.up, self.down) if lk is not None),
            "aborted": self.failed,
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

    def _feed(self, groups: Iterable[Group]) -> None:
        ordinal = 0
        mb = 0
        for group in groups:
            if self.failed is not None:
                return
            if self.stop_flag is not None and self.stop_flag.is_set():
                break
            g = ordinal
            ordinal += 1
            with self._cond:
                self._sizes[g] = len(group.batches)
                # at most two groups open: group g waits for group g - 2 to come back
                while (
                    g >= 2
                    and self.failed is None
                    and self._completed.get(g - 2, 0) < self._sizes[g - 2]
                ):
                    self._wait_cond()
            info = {
                "g": g,
                "seq": group.seq,
                "gn": len(group.batches),
                "covers": group.covers,
                "lr": group.lr,
                "images": group.images,
            }
            for x, y in group.batches:
                with self._cond:
                    while self.failed is None and self._in_flight >= self.window:
                        self._wait_cond()
                    if self.failed is not None:
                        return
                    self._in_flight += 1
                self._work.put((1, next(self._order), ("f", mb, info, x, y)))
                mb += 1
        with self._cond:  # every mini-batch back from every partition
            while self.failed is None and self._in_flight > 0:
                self._wait_cond()
        self._done.set()

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
                        out = stage.forward_into(ctx, values, n)
                        with self._lock:
                            self._pending[mb] = (ctx, info)
                        header = {k: info[k] for k in ("g", "seq", "gn", "covers", "lr", "images")}
                        header.update(
                            op="f", mb=mb, n=n, y=np.ascontiguousarray(y, np.int64).tobytes()
                        )
                        assert self.down is not None
                        self.down.send(header, out)
                else:
                    with self._lock:
                        ctx, info = self._pending.pop(mb)
                    n = len(values)
                    acc = self._acc(t, info["g"])
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
        acc, lr = self._acc(t, info["g"]), info["lr"]
        if self._fused:
            return self.stage.step(ctx, x, y, n, lr, acc, **self._steps[t])
        self.stage.forward_into(ctx, x, n)
        return self.stage.backward_update(ctx, n, lr, acc, labels=y, **self._steps[t])

    def _acc(self, t: int, g: int) -> np.ndarray:
        """Thread ``t``'s accumulator for group ``g``, marked as holding updates."""
        self._touched[t][g % 2] = True
        return self._accs[t][g % 2]

    def _applied(self, info: dict) -> None:
        """A mini-batch of group ``info["g"]`` was applied here; the last one takes the group
        (before its errors leave this partition)."""
        g = info["g"]
        with self._lock:
            grp = self._groups.get(g)
            if grp is None:
                grp = self._groups[g] = _Open(g, info["seq"], info["gn"], info["covers"])
            grp.applied += 1
            complete = grp.applied == grp.size
            if complete:
                del self._groups[g]
        if complete:
            grp.images = int(info["images"])
            spare = self._buffers.get()
            parity = g % 2
            # No thread writes this parity's accumulators now: the group's mini-batches are all
            # applied here, and group g + 2 starts after this one's errors left every partition.
            with self._take_lock:  # not while an install reads the accumulators
                buf = self._accs[0][parity]
                self._accs[0][parity] = spare
                self._touched[0][parity] = False
                for t in range(1, self.threads):
                    buf += self._accs[t][parity]
                    self._accs[t][parity][...] = 0.0
                    self._touched[t][parity] = False
                self._unpushed.append(buf)
            self._communicator.put((grp, buf))

    # -- the exchange with the parameter server ----------------------------------------------

    def _forget_unpushed(self, buf: np.ndarray) -> None:
        """Take ``buf`` out of the unpushed buffers, by identity (``list.remove`` compares
        arrays with ``==``: elementwise, an error once another buffer comes first)."""
        for i, u in enumerate(self._unpushed):
            if u is buf:
                del self._unpushed[i]
                return

    def _send(self, item: tuple[_Open, np.ndarray]) -> None:
        """Push a group's update (``item``: the group and the buffer its update was taken into)
        as this partition's part of the group's push, with the span read back in the same round
        trip, and install it; nothing when the replica runs again (it may have been frozen)."""
        grp, buf = item
        if self.error is not None or (self.abort_flag is not None and self.abort_flag.is_set()):
            self._drop(item)
            return
        try:
            t = time.perf_counter()
            epoch, replica, replicas = self.mark
            mark = Mark(epoch, replica, grp.seq, self.index, self.parts, replicas, grp.covers)
            pulled = self.server.push_range(buf, self.stage.start, mark=mark, out=self._pulled)
            assert pulled is not None
            with self._take_lock:
                self._forget_unpushed(buf)
            with self._lock:
                self.pushes += 1
                self.images_pushed += grp.images
                self.groups_pushed.append(grp.seq)
            self.ps_seconds += time.perf_counter() - t
            self._install(pulled)
        finally:
            self._recycle(buf)

    def _drop(self, item: tuple[_Open, np.ndarray]) -> None:
        """A group's update (``item``: the group and its buffer) is not pushed: forgotten, its
        buffer recycled."""
        _, buf = item
        with self._take_lock:
            self._forget_unpushed(buf)
        self._recycle(buf)

    def _recycle(self, buf: np.ndarray) -> None:
        """``buf`` zeroed back to the buffers a take swaps in."""
        buf[...] = 0.0
        self._buffers.put(buf)

    def _install(self, pulled: np.ndarray) -> None:
        """The pulled span, plus what this partition applied and the server does not hold yet
        (groups taken but not pushed, the accumulators that hold updates), as its weights:
        summed into ``pulled`` aside (:func:`~adam_dask.train._updates.summed`, under the take
        lock, so that no group moves from an accumulator to the unpushed meanwhile), then
        copied over the weights in one pass. The threads train on meanwhile (Hogwild): an
        update landing during the copy may be lost locally, but it is in its accumulator,
        pushed, and back with the next pull."""
        with self._take_lock:
            addends = list(self._unpushed)
            for t, pair in enumerate(self._accs):
                addends += [acc for p, acc in enumerate(pair) if self._touched[t][p]]
            summed(pulled, pulled, addends)
        np.copyto(self.stage.flat, pulled)
