"""The Dask side of a model replica: one epoch of one replica as a long-running task.

:func:`run_replica` runs on a TRAIN worker. It secedes (so it holds no thread slot and is never
stolen), builds a :class:`~adam_dask.train.replica.HogwildReplica` (the Dask-free engine), pulls
the weights from the parameter server, and trains on its share of the epoch from a
:class:`~adam_dask.data.serving.BatchStream`. Every ``push_every`` images (the paper's *k*) one
training thread pushes the accumulated delta and pulls fresh weights while the others go on.

Control and reporting stay cheap: the stop signal (the 75% epoch rule) is a
:class:`distributed.Event` polled once per push, and progress goes to the client as a
``log_event`` on the topic ``adam-progress`` at most twice a second.

Mode ``sync`` (the baseline): each replica runs one thread; at every step (``push_every``
images) it pushes its delta divided by the number of replicas and waits at a
:class:`SyncBarrier` until every replica has pushed, then pulls. The PS thus applies the average
of the replicas' updates, and every replica starts each step from the same weights.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import UpdateRejected

logger = logging.getLogger(__name__)

PROGRESS_TOPIC = "adam-progress"


@dataclass(frozen=True)
class ReplicaJob:
    """Everything one replica needs for one epoch; small and picklable."""

    run_id: str
    replica: int
    replicas: int
    epoch: int
    model: dict  # Network.to_dict()
    mode: str  # "async" or "sync"
    push_every: int
    lr: float
    momentum: float
    batch_size: int
    threads: int
    seed: int = 0
    delay: float = 0.0  # seconds of sleep per batch: a deliberately slow replica (experiments)
    report_interval: float = 0.5
    sync_timeout: float = 60.0  # seconds a sync step waits for the other replicas
    offload_dense: bool | tuple = False  # True: the profitable dense layers; or layer prefixes

    @property
    def stop_name(self) -> str:
        return f"adam-{self.run_id}-stop-{self.epoch}"


class SyncBarrier:
    """A barrier for synchronous mode, as a Dask actor with async methods (no thread needed).

    ``await wait()`` returns once every party still in the epoch has arrived at the current
    generation (one step), which then advances. A replica restarted after its worker died simply
    joins the current generation. ``leave()`` takes a party out (a replica that finished its
    share); a barrier that waits longer than ``timeout`` lets its waiters go rather than hang.
    """

    def __init__(self, parties: int):
        self.parties = int(parties)
        self.count = 0
        self.generation = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _release(self) -> None:
        self.generation += 1
        self.count = 0
        self._condition().notify_all()

    async def wait(self, timeout: float = 60.0) -> bool:
        cond = self._condition()
        async with cond:
            gen = self.generation
            self.count += 1
            if self.count >= self.parties:
                self._release()
                return True
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self.generation != gen), timeout)
                return True
            except TimeoutError:
                logger.warning(
                    "sync barrier: generation %d timed out with %d of %d replicas",
                    gen,
                    self.count,
                    self.parties,
                )
                if self.generation == gen:
                    self._release()
                return False

    async def leave(self) -> int:
        cond = self._condition()
        async with cond:
            self.parties = max(0, self.parties - 1)
            if self.count and self.count >= self.parties:
                self._release()
            return self.parties


class _Counted:
    """Wraps a batch iterator: counts the images drawn (live progress), and sleeps ``delay``
    seconds per batch when set (a deliberately slow replica, for straggler experiments)."""

    def __init__(self, it, delay: float = 0.0):
        self.it, self.delay = iter(it), delay
        self.images = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.it)
        self.images += len(item[1])
        if self.delay:
            time.sleep(self.delay)
        return item


class _Communicator:
    """One background thread per replica that pushes deltas and pulls fresh weights, so the
    training threads never wait for the parameter server (async mode).

    At most one delta waits behind the one in flight: a replica that outruns the PS slows down
    rather than piling up memory. Taking a delta and installing pulled weights share a lock,
    because both move the replica's snapshot; the training threads never take it.
    """

    def __init__(self, rep, push: Callable, pull: Callable):
        self.rep, self.push, self.pull = rep, push, pull
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._run,),
            name="adam-communicator",
            daemon=True,
        )
        self.thread.start()

    def take_update(self) -> tuple[np.ndarray, dict]:
        with self.lock:
            return self.rep.take_update()

    def submit(self, update: tuple[np.ndarray, dict]) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(update)

    def _run(self) -> None:
        while True:
            update = self.queue.get()
            if update is None:
                return
            if self.error is not None:
                continue
            try:
                self.push(update)
                weights = self.pull()
                with self.lock:
                    self.rep.set_weights(weights, keep_pending=True)
            except BaseException as exc:  # raised in the training thread at the next submit
                self.error = exc
                self.rep.stop()

    def close(self) -> None:
        """Wait until every submitted delta is pushed; raise the first error."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def run_replica(job: ReplicaJob, server, data, barrier=None) -> dict:
    """Train replica ``job.replica`` for epoch ``job.epoch``; returns its statistics.

    Runs inside a Dask task on a TRAIN worker. ``server`` is a
    :class:`~adam_dask.ps.server.ParameterServer`, ``data`` a
    :class:`~adam_dask.data.serving.DataService`, ``barrier`` a :class:`SyncBarrier` actor
    (sync mode only).
    """
    from distributed import Event, get_worker, secede

    from ..model.network import Network
    from .replica import HogwildReplica, profitable_offload

    secede()
    worker = get_worker()
    t0 = time.perf_counter()
    net = Network.from_dict(job.model)
    sync = job.mode == "sync"
    offload = (
        profitable_offload(net, job.push_every)
        if job.offload_dense is True
        else list(job.offload_dense or ())
    )
    rep = HogwildReplica(
        net,
        threads=1 if sync else job.threads,
        lr=job.lr,
        momentum=job.momentum,
        batch_size=job.batch_size,
        offload=offload,
    )
    offsets = {p: net.layout[f"{p}.weight"].offset for p in offload}
    rep.set_weights(server.pull())
    stream = data.stream(job.replica, job.replicas, job.epoch)
    stop = Event(job.stop_name)
    state = {"pushes": 0, "last_report": 0.0, "ps_seconds": 0.0, "stopped": False}

    def report(final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - state["last_report"] < job.report_interval:
            return
        state["last_report"] = now
        worker.log_event(
            PROGRESS_TOPIC,
            {
                "run": job.run_id,
                "epoch": job.epoch,
                "replica": job.replica,
                "images": batches.images,
                "pushes": state["pushes"],
                "final": final,
                "seconds": now - t0,
            },
        )

    def push(update: tuple[np.ndarray, dict], scale: float = 1.0) -> None:
        delta, terms = update
        t = time.perf_counter()
        try:  # the server checks every value (NaN/Inf refused, nothing applied)
            server.push(delta * scale if scale != 1.0 else delta)
            for prefix, (acts, errs) in terms.items():  # the PS computes these layers' updates
                server.push_outer(offsets[prefix], errs, acts, scale=scale)
        except UpdateRejected as exc:
            raise UpdateRejected(
                f"replica {job.replica} produced a non-finite update in epoch "
                f"{job.epoch} (the model diverged): {exc.message}",
                "lower the learning rate (--lr) or push_every",
                shard=exc.shard,
            ) from exc
        state["ps_seconds"] += time.perf_counter() - t
        state["pushes"] += 1

    def pull() -> np.ndarray:
        t = time.perf_counter()
        w = server.pull()
        state["ps_seconds"] += time.perf_counter() - t
        return w

    def on_images(r: HogwildReplica) -> None:
        if sync:
            push(r.take_update(), 1.0 / job.replicas)
            barrier.wait(job.sync_timeout).result()
            r.set_weights(pull())
        else:
            comm.submit(comm.take_update())
        report()
        if stop.is_set():
            state["stopped"] = True
            r.stop()

    comm = None if sync else _Communicator(rep, push, pull)
    batches = _Counted(stream, job.delay)
    if stop.is_set():  # the epoch's quorum was reached before this replica started
        state["stopped"] = True
        batches = _Counted(())
    try:
        stats = rep.train(batches, on_images=on_images, every=job.push_every)
        if comm is not None:
            comm.close()
            comm = None
        rest = rep.take_update()
        if np.any(rest[0]) or rest[1]:
            push(rest, 1.0 / job.replicas if sync else 1.0)
    finally:
        if comm is not None:  # training failed: stop the communicator, keep the first error
            try:
                comm.close()
            except BaseException:
                logger.debug("communicator error after a training error", exc_info=True)
        if sync and barrier is not None:
            barrier.leave().result()
        stream_stats = stream.stats()
        stream.close()
    report(final=True)
    return {
        "replica": job.replica,
        "epoch": job.epoch,
        "images": stats.images,
        "loss": stats.loss,
        "seconds": time.perf_counter() - t0,
        "train_seconds": stats.seconds,
        "pushes": state["pushes"],
        "ps_seconds": state["ps_seconds"],
        "stopped": bool(state["stopped"] or stats.stopped),
        "stall_fraction": float(stream_stats.get("stall_fraction", 0.0)),
        "wait_seconds": float(stream_stats.get("wait_seconds", 0.0)),
        "worker": worker.address,
    }
