"""A model replica in one process: T threads train one set of weights lock-free (Hogwild).

This is the compute core of a model-training machine (Adam paper, section 3.2), free of Dask:
the distributed trainer wraps it in a long-running task and talks to the parameter server.

* The T threads share ``net.flat`` and add their updates to it without locks. Updates are sums,
  so they commute; a rare lost update between two threads is noise SGD tolerates (Hogwild).
* Each thread owns a pre-allocated :class:`~adam_dask.model.network.Context` (activations, error
  terms, im2col patches, a private gradient buffer), so the hot loop allocates nothing.
* Granularity: each thread computes the gradient of a small mini-batch (``batch_size``, config
  ``adam.train.batch-size``, default 8) into its private buffer and applies it in one pass.
  Per-image updates, as in the paper, work (``batch_size=1``) but are slower here: every update
  writes all 1.2 MB of weights, one image's dense layers are matrix-vector products that reuse no
  weight row from cache, and the per-call overhead (~20 kernel calls) is paid per image.
  Measured on the paper's MNIST net, 2 threads, 2 shared cores (``benchmarks/engine.py
  --granularity``, images/s by batch size): 1: 5.9k, 2: 8.5k, 4: 11.3k, 8: 12.9k, 16: 16.0k,
  32: 14.0k (noisy: the box was shared). Past ~16 the im2col patches and activations leave L2.
  8 keeps updates frequent (Hogwild staleness stays small, 3-epoch accuracy unchanged) at most of
  the speed; 16 is a reasonable choice for pure throughput.
* The delta for the parameter server: the updates applied to ``flat`` since the last sync are
  ``flat - snapshot``, where ``snapshot`` is the weights at the last :meth:`take_delta` /
  :meth:`set_weights`. Keeping the snapshot instead of a running sum costs nothing in the hot loop
  and stays exact under Hogwild races (a lost update is lost from both).

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

import numpy as np

from .. import config
from ..errors import ConfigError, InputShapeError
from ..model import kernels as K
from ..model.network import Network

logger = logging.getLogger(__name__)


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
    """An iterator several threads may pull from; ``next()`` returns None when exhausted."""

    def __init__(self, iterable: Iterable):
        self._it = iter(iterable)
        self._lock = threading.Lock()
        self._done = False

    def next(self):
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


def profitable_offload(net: Network, push_every: int) -> list[str]:
    """The dense layers worth offloading: those whose ``k * (in + out)`` floats of activations
    and error terms per push are fewer than the ``in * out`` of their weight delta (the paper's
    rule for sending terms instead of updates)."""
    out = []
    for name, view in net.parameters.items():
        if name.endswith(".weight") and view.ndim == 2:
            o, i = view.shape
            if push_every * (i + o) < i * o:
                out.append(name.rsplit(".", 1)[0])
    return out


class HogwildReplica:
    """T threads training ``net`` in place, lock-free, with a delta ready for a parameter server.

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
    lr_decay : float, optional
        Factor per epoch for :meth:`lr_at` (config ``adam.train.lr-decay``).
    """

    def __init__(
        self,
        net: Network,
        threads: int | None = None,
        lr: float | None = None,
        momentum: float | None = None,
        batch_size: int | None = None,
        lr_decay: float | None = None,
        offload: Iterable[str] | None = None,
    ):
        self.net = net
        self.threads = int(config.get("cluster.trainer-threads", threads))
        self.base_lr = float(config.get("train.lr", lr))
        self.lr = self.base_lr
        self.momentum = float(config.get("train.momentum", momentum))
        self.batch_size = int(config.get("train.batch-size", batch_size))
        self.lr_decay = float(config.get("train.lr-decay", lr_decay))
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
        self._snapshot = net.flat.copy()
        # dense layers whose updates also leave as (activations, -lr * errors) terms
        self.offload = sorted(set(offload or ()))
        for prefix in self.offload:
            if (
                f"{prefix}.weight" not in net.parameters
                or len(net.parameters[f"{prefix}.weight"].shape) != 2
            ):
                raise ConfigError(
                    f"layer {prefix} is not a dense layer; only dense layers offload",
                    "name dense layers, e.g. offload=['4', '5']",
                )
        if self.offload and self.momentum > 0:
            raise ConfigError(
                "offloading dense layers needs momentum 0 (the server applies "
                "plain outer-product updates)",
                "set momentum=0 or offload=None",
            )
        self._terms: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {p: [] for p in self.offload}
        self._terms_lock = threading.Lock()
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

    def lr_at(self, epoch: int) -> float:
        """The scheduled learning rate of ``epoch`` (0-based): ``base_lr * lr_decay ** epoch``."""
        return self.base_lr * self.lr_decay ** int(epoch)

    def set_epoch(self, epoch: int) -> float:
        """Set ``lr`` to :meth:`lr_at` ``(epoch)`` and return it."""
        self.lr = self.lr_at(epoch)
        return self.lr

    # -- parameter-server sync ------------------------------------------------------------------

    def take_delta(self) -> np.ndarray:
        """A copy of the updates applied to ``net.flat`` since the last take_delta/set_weights,
        and reset that delta to zero. Safe while threads train: an update landing during the
        call is counted now or in the next delta, never twice and never dropped."""
        now = self.net.flat.copy()  # one read of each value: the cut between deltas
        delta = now - self._snapshot
        self._snapshot = now
        return delta

    def _record_terms(self, terms: dict) -> None:
        scale = np.float32(-self.lr)
        with self._terms_lock:
            for prefix in self.offload:
                a, e = terms[prefix]
                e *= scale
                self._terms[prefix].append((a, e))

    def take_offload(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The dense-layer terms recorded since the last call, and reset them: prefix ->
        (activations (N, in), errors (N, out)) with ``errors.T @ activations`` equal to the
        updates applied to ``<prefix>.weight`` (the bias updates stay in the delta)."""
        with self._terms_lock:
            taken = self._terms
            self._terms = {p: [] for p in self.offload}
        out = {}
        for prefix, items in taken.items():
            if items:
                out[prefix] = (
                    np.concatenate([a for a, _ in items]),
                    np.concatenate([e for _, e in items]),
                )
        return out

    def take_update(self) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """:meth:`take_delta` and :meth:`take_offload` together, the offloaded weights zeroed in
        the delta (they travel as terms). Without offloaded layers the terms are empty."""
        terms = self.take_offload()
        delta = self.take_delta()
        for prefix in self.offload:
            e = self.net.layout[f"{prefix}.weight"]
            delta[e.offset : e.offset + e.size] = 0.0
        return delta, terms

    def peek_delta(self) -> np.ndarray:
        """The accumulated delta, without resetting it."""
        return self.net.flat - self._snapshot

    def set_weights(self, flat: np.ndarray, keep_pending: bool = False) -> None:
        """Copy new weights in (after a pull) and zero the delta. With ``keep_pending``, the
        updates not yet taken are re-applied on top of ``flat`` and stay in the delta."""
        flat = np.asarray(flat, dtype=np.float32)
        if flat.shape != self.net.flat.shape:
            raise InputShapeError(
                f"expected {self.net.flat.shape[0]} weights, got shape {flat.shape}"
            )
        if keep_pending:
            pending = self.net.flat - self._snapshot
            self._snapshot[...] = flat
            self.net.flat[...] = flat + pending
        else:
            self._snapshot[...] = flat
            self.net.flat[...] = flat

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
        stop_event: threading.Event | None = None,
    ) -> TrainStats:
        """Train on ``batches`` with the replica's threads until it is exhausted or stopped.

        Parameters
        ----------
        batches : iterable of (x, y)
            x float32 (B, C, H, W), y integer (B,). The threads pull from it (one at a time,
            under a lock); a batch larger than ``batch_size`` is split into updates of
            ``batch_size`` images.
        on_images : callable(replica), optional
            Called about every ``every`` images (config ``adam.train.push-every``) by one of the
            training threads, while the others go on; never two calls at once. The place to
            :meth:`take_delta`, push, pull and :meth:`set_weights`.
        stop_event : threading.Event, optional
            Also stop when this event is set (besides :meth:`stop`).

        Returns
        -------
        TrainStats
        """
        self._stop.clear()
        every = int(config.get("train.push-every", every)) if on_images is not None else 0
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
        images = sum(r[0] for r in results)
        loss = sum(r[1] for r in results) / images if images else float("nan")
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
        schedule: bool = True,
        on_images: Callable[[HogwildReplica], None] | None = None,
        every: int | None = None,
        on_epoch: Callable[[HogwildReplica, int, TrainStats], None] | None = None,
    ) -> TrainStats:
        """Train on in-memory images for ``epochs`` epochs (reshuffled each epoch).

        ``x`` is anything :meth:`Network.as_images` accepts (uint8 images are scaled by 1/255),
        ``y`` integer labels. With ``schedule``, epoch ``e`` runs at ``lr_at(first_epoch + e)``.
        ``on_epoch(replica, epoch, stats)`` runs after each epoch. Returns the totals.
        """
        x = self.net.as_images(x)
        y = self.net.check_labels(y, x.shape[0])
        seed = int(config.get("train.seed", seed))
        rng = np.random.default_rng(seed)
        bs = self.batch_size
        self._data = (x, y)
        images, loss_sum, seconds, stopped = 0, 0.0, 0.0, False
        try:
            for e in range(int(epochs)):
                if schedule:
                    self.set_epoch(first_epoch + e)
                order = rng.permutation(len(x)) if shuffle else np.arange(len(x))
                gen = (_Gather(order[s : s + bs]) for s in range(0, len(x), bs))
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
        flat = net.flat
        bs = self.batch_size
        stop = self._stop
        images, loss_sum = 0, 0.0
        ctx.grad[...] = 0.0
        while not stop.is_set() and (stop_event is None or not stop_event.is_set()):
            item = it.next()
            if item is None:
                break
            if isinstance(item, _Gather):
                n = len(item.idx)
                X, Y = self._data
                np.take(X, item.idx, axis=0, out=xbuf[:n])
                np.take(Y, item.idx, axis=0, out=ybuf[:n])
                x, y = xbuf, ybuf
                chunks = [(0, n)]
            else:
                x, y = item
                x = net.check_input(x)
                y = net.check_labels(y, x.shape[0])
                n = x.shape[0]
                chunks = [(s, min(bs, n - s)) for s in range(0, n, bs)]
            for s, m in chunks:
                xs = x[s : s + m] if s else x
                ys = y[s : s + m] if s else y
                terms = {} if self.offload else None
                loss = net.backward_into(ctx, xs, ys, m, dense_terms=terms)
                K.sgd_update(flat, ctx.grad, vel, self.lr, self.momentum)
                if terms:
                    self._record_terms(terms)
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
