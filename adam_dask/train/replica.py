"""A model replica in one process: T threads train one set of weights lock-free (Hogwild).

The compute core of a model-training machine (Adam paper, section 3.2), free of Dask, trained
alone (benchmarks measure it so); on a cluster a replica runs the same fused step as the
pipeline's one stage (:mod:`._pipeline`), whose exchange talks to the parameter server.

* The T threads share ``net.flat`` and add their updates to it without a common lock. Updates
  are sums, so they commute; a rare update lost between two threads is noise SGD tolerates.
* Each thread owns a pre-allocated :class:`~adam_dask.model.network.Context` (activations, error
  terms, im2col patches, a private gradient buffer), so the hot loop allocates nothing.
* Granularity: each thread steps a small mini-batch (``batch_size``, config
  ``adam.train.batch-size``) with the fused step (:meth:`Network.step_into`: forward, backward
  and update in one numba call that releases the GIL throughout). Per-image updates, as in the
  paper, work (``batch_size=1``) but are slower here: every update writes all the weights, and
  one image's dense layers reuse no weight row from cache. The paper's MNIST net, 2 threads, 2
  shared cores (``benchmarks/engine.py --granularity``), images/s by batch size: 1: 5.9k,
  2: 8.5k, 4: 11.3k, 8: 12.9k, 16: 16.0k, 32: 14.0k.
* The rate follows the schedule of the run's progress (:meth:`set_progress`); ``on_images``
  runs a caller's code every ``every`` images (one thread at a time) while the others train.

>>> from adam_dask.model import Network
>>> net = Network.from_spec("conv3x3:4,maxpool2,fc10", input_shape=(1, 8, 8), seed=0)
>>> rep = HogwildReplica(net, threads=2, lr=0.1, batch_size=4)
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from .. import config, sizing
from ..data.augment import to_float
from ..errors import ConfigError, InputShapeError
from ..model.network import Network
from .schedule import Schedule
from .streams import resolve_push_every

__all__ = ["HogwildReplica", "TrainStats"]

logger = logging.getLogger(__name__)


class Flag(Protocol):
    """A stop signal: a :class:`threading.Event`, or anything else with ``is_set()``."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class TrainStats:
    """What one :meth:`HogwildReplica.train` call did."""

    images: int
    loss: float  # mean training loss over those images (nan when none)
    seconds: float
    stopped: bool  # True when stop() (or the stop event) ended it early

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "images_per_second": self.images_per_second}


class _SafeIterator:
    """An iterator several threads may pull from: ``next()`` returns the next item, or None
    once exhausted."""

    def __init__(self, iterable: Iterable):
        self._it = iter(iterable)
        self._lock = threading.Lock()
        self._done = False

    def next(self) -> object | None:
        with self._lock:
            if self._done:
                return None
            try:
                return next(self._it)
            except StopIteration:
                self._done = True
                return None


class _Gather:
    """An index batch into the replica's in-memory arrays (train_images): the thread gathers the
    images into its own pre-allocated buffer instead of allocating a batch."""

    __slots__ = ("idx",)

    def __init__(self, idx: np.ndarray):
        self.idx = idx


class HogwildReplica:
    """T threads training ``net`` in place, lock-free.

    Parameters
    ----------
    net : Network
        Trained in place: ``net.flat`` is the replica's weights.
    threads : int, optional
        Hogwild threads (config ``adam.cluster.trainer-threads``).
    lr : float, optional
        Learning rate (config ``adam.train.lr``); settable at any time as ``replica.lr``.
    momentum : float, optional
        Momentum (config ``adam.train.momentum``); 0 for plain SGD. Each thread keeps its own
        velocity.
    batch_size : int, optional
        Images per update in each thread (config ``adam.train.batch-size``); 1 = the paper's
        per-image updates.
    schedule : Schedule, optional
        The learning rate over the run, applied by :meth:`set_progress` (default: constant
        ``lr``).
    """

    def __init__(
        self,
        net: Network,
        threads: int | None = None,
        lr: float | None = None,
        momentum: float | None = None,
        batch_size: int | None = None,
        schedule: Schedule | None = None,
    ):
        self.net = net
        self.threads = sizing.resolve_threads(config.get("cluster.trainer-threads", threads))
        if lr is None and schedule is not None:
            lr = schedule.lr
        self.base_lr = float(config.get("train.lr", lr))
        self.lr = self.base_lr
        self.schedule = schedule
        self.damping = 1.0  # on the schedule's rate; < 1 while pushing less often (exchange)
        self.lr_damping = 1.0  # the damping ``lr`` carries (set_progress applied it)
        self.momentum = float(config.get("train.momentum", momentum))
        self.batch_size = int(config.get("train.batch-size", batch_size))
        if self.threads < 1:
            raise ConfigError(
                f"threads={self.threads}: a replica needs at least one thread",
                "set threads= or adam.cluster.trainer-threads",
            )
        if self.batch_size < 1:
            raise ConfigError(
                f"batch_size={self.batch_size} must be at least 1",
                "set batch_size= or adam.train.batch-size",
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(
                f"momentum={self.momentum} must lie in [0, 1)",
                "set momentum= or adam.train.momentum",
            )
        if self.base_lr <= 0:
            raise ConfigError(f"lr={self.base_lr} must be positive", "set lr= or adam.train.lr")
        self._contexts = [net.context(self.batch_size) for _ in range(self.threads)]
        c, h, w = net.input_shape
        self._xbufs = [
            np.zeros((self.batch_size, c, h, w), np.float32) for _ in range(self.threads)
        ]
        self._ybufs = [np.zeros(self.batch_size, np.int64) for _ in range(self.threads)]
        n = net.layout.size if self.momentum > 0 else 1
        self._velocity = [np.zeros(n, np.float32) for _ in range(self.threads)]
        self._stop = threading.Event()
        self._count_lock = threading.Lock()
        self._since = 0
        self._in_callback = False
        self.images_seen = 0
        self._data: tuple[np.ndarray, np.ndarray] | None = None

    def __repr__(self) -> str:
        return (
            f"HogwildReplica(threads={self.threads}, lr={self.lr:g}, "
            f"momentum={self.momentum:g}, batch_size={self.batch_size}, net={self.net!r})"
        )

    # -- schedule ---------------------------------------------------------------------------------

    def set_progress(self, epochs: float) -> float:
        """Set ``lr`` to the schedule's rate after ``epochs`` (fractional) epochs of the run
        times :attr:`damping` and return it; without a schedule ``lr`` stays as it is."""
        if self.schedule is not None:
            self.lr_damping = self.damping
            self.lr = self.schedule.at(epochs) * self.damping
        return self.lr

    def set_weights(self, weights: np.ndarray) -> None:
        """Copy ``weights`` (flat float32, the model's size) over the replica's."""
        np.copyto(self.net.flat, self._check_weights(weights))

    def _check_weights(self, weights: np.ndarray) -> np.ndarray:
        weights = np.asarray(weights, dtype=np.float32)
        if weights.shape != self.net.flat.shape:
            raise InputShapeError(
                f"expected {self.net.flat.shape[0]} weights, got shape {weights.shape}"
            )
        return weights

    # -- stopping ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the running :meth:`train` to end promptly: each thread finishes its current
        mini-batch (milliseconds) and exits."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # -- training ---------------------------------------------------------------------------------

    def train(
        self,
        batches: Iterable,
        on_images: Callable[[HogwildReplica], None] | None = None,
        every: int | None = None,
        stop_event: Flag | None = None,
    ) -> TrainStats:
        """Train on ``batches`` with the replica's threads until it is exhausted or stopped.

        Parameters
        ----------
        batches : iterable of (x, y)
            x float32 (B, C, H, W), y integer (B,). The threads pull from it (one at a time,
            under a lock); a batch larger than ``batch_size`` is split into updates of
            ``batch_size`` images. A batch ``(x, y, key)`` (a data service's stream) trains
            as ``(x, y)``.
        on_images : callable(replica), optional
            Called about every ``every`` images (config ``adam.train.push-every``) by one of the
            training threads, while the others go on; never two calls at once (a progress
            report, a change of ``lr``, a look at the weights).
        stop_event : threading.Event, optional
            Also stop when this event (anything with ``is_set()``) is set (besides
            :meth:`stop`); asked once per mini-batch.

        Returns
        -------
        TrainStats
        """
        self._stop.clear()
        every = config.get("train.push-every", every)
        every = resolve_push_every(every, 1) if on_images is not None else 0
        it = _SafeIterator(batches)
        results: list[tuple[int, float] | BaseException] = [(0, 0.0)] * self.threads
        with self._count_lock:
            self._since = 0
        t0 = time.perf_counter()
        if self.threads == 1:
            self._run(0, it, results, on_images, every, stop_event)
        else:
            # each thread runs in a copy of the caller's context, so context variables (a Dask
            # worker's identity inside a task, for instance) reach the callbacks and iterators
            workers = [
                threading.Thread(
                    target=contextvars.copy_context().run,
                    name=f"hogwild-{t}",
                    daemon=True,
                    args=(self._run, t, it, results, on_images, every, stop_event),
                )
                for t in range(self.threads)
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        seconds = time.perf_counter() - t0
        for r in results:
            if isinstance(r, BaseException):
                raise r
        images = sum(r[0] for r in results if not isinstance(r, BaseException))
        loss_sum = sum(r[1] for r in results if not isinstance(r, BaseException))
        loss = loss_sum / images if images else float("nan")
        stopped = self._stop.is_set() or (stop_event is not None and stop_event.is_set())
        self.images_seen += images
        logger.debug("trained %d images in %.3fs (loss %.4f)", images, seconds, loss)
        return TrainStats(images, loss, seconds, stopped)

    def train_images(
        self,
        x,
        y,
        epochs: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
        first_epoch: int = 0,
        schedule: Schedule | bool = True,
        on_images: Callable[[HogwildReplica], None] | None = None,
        every: int | None = None,
        on_epoch: Callable[[HogwildReplica, int, TrainStats], None] | None = None,
    ) -> TrainStats:
        """Train on in-memory images for ``epochs`` epochs (reshuffled each epoch).

        ``x`` is anything :meth:`Network.as_images` accepts (uint8 images are scaled by 1/255),
        ``y`` integer labels. ``schedule``: True follows the replica's schedule, or one over
        ``first_epoch + epochs`` planned epochs from ``lr`` (``adam.train.lr-schedule``,
        ``lr-floor``), moved at every mini-batch; a :class:`Schedule` is used as given; False
        keeps ``lr``. ``on_epoch(replica, epoch, stats)`` runs after each epoch. Returns the
        totals.
        """
        x = np.asarray(x)
        if x.dtype == np.uint8:
            x = to_float(x)  # the package's one input conversion; the layout is the model's
        x = self.net.as_images(x)
        y = self.net.check_labels(y, x.shape[0])
        seed = int(config.get("train.seed", seed))
        rng = np.random.default_rng(seed)
        bs = self.batch_size
        if schedule is True:
            schedule = self.schedule or Schedule.from_config(
                lr=self.base_lr, epochs=first_epoch + int(epochs)
            )
        plan = schedule if isinstance(schedule, Schedule) else None
        self._data = (x, y)
        images, loss_sum, seconds, stopped = 0, 0.0, 0.0, False
        try:
            for e in range(int(epochs)):
                order = rng.permutation(len(x)) if shuffle else np.arange(len(x))
                gen = self._gathers(order, bs, plan, first_epoch + e)
                st = self.train(gen, on_images=on_images, every=every)
                images += st.images
                loss_sum += st.loss * st.images if st.images else 0.0
                seconds += st.seconds
                if on_epoch is not None:
                    on_epoch(self, first_epoch + e, st)
                if st.stopped:
                    stopped = True
                    break
        finally:
            self._data = None
        return TrainStats(images, loss_sum / images if images else float("nan"), seconds, stopped)

    def _gathers(self, order: np.ndarray, bs: int, plan: Schedule | None, epoch: int):
        n = len(order)
        for s in range(0, n, bs):
            if plan is not None:
                self.lr = plan.at(epoch + s / n)
            yield _Gather(order[s : s + bs])

    # -- the thread body ----------------------------------------------------------------------------

    def _run(self, t, it, results, on_images, every, stop_event) -> None:
        try:
            results[t] = self._loop(t, it, on_images, every, stop_event)
        except BaseException as e:  # re-raised by train() in the calling thread
            self._stop.set()
            results[t] = e

    def _loop(self, t, it, on_images, every, stop_event) -> tuple[int, float]:
        net = self.net
        ctx = self._contexts[t]
        xbuf, ybuf = self._xbufs[t], self._ybufs[t]
        vel = self._velocity[t]
        bs = self.batch_size
        stop = self._stop
        images, loss_sum = 0, 0.0
        ctx.grad[...] = 0.0  # the fused step leaves it zero; start from zero too
        while not stop.is_set() and (stop_event is None or not stop_event.is_set()):
            item = it.next()
            if item is None:
                break
            if isinstance(item, _Gather):
                n = len(item.idx)
                assert self._data is not None  # train_images set it
                X, Y = self._data
                np.take(X, item.idx, axis=0, out=xbuf[:n])
                np.take(Y, item.idx, axis=0, out=ybuf[:n])
                x, y = xbuf, ybuf
                chunks = [(0, n)]
            else:
                x, y = item[0], item[1]  # (x, y) or (x, y, key)
                x = net.check_input(x)
                y = net.check_labels(y, x.shape[0])
                n = x.shape[0]
                chunks = [(s, min(bs, n - s)) for s in range(0, n, bs)]
            for s, m in chunks:
                xs = x[s : s + m] if s else x
                ys = y[s : s + m] if s else y
                loss = net.step_into(ctx, xs, ys, m, self.lr, self.momentum, vel)
                images += m
                loss_sum += loss * m
                if every:
                    self._maybe_callback(on_images, every, m)
                if stop.is_set():
                    break
        return images, loss_sum

    def _maybe_callback(self, on_images, every: int, m: int) -> None:
        with self._count_lock:
            self._since += m
            if self._since < every or self._in_callback:
                return
            self._since = 0
            self._in_callback = True
        try:
            on_images(self)
        finally:
            with self._count_lock:
                self._in_callback = False
