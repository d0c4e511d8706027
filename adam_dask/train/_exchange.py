"""One object owns a replica's exchange with the parameter server: take -> push -> pull -> install.

A training thread calls :meth:`Exchange.step` every ``push_every`` images (the paper's *k*) and
:meth:`Exchange.finish` once its share is done. Two kinds:

* :class:`AsyncExchange` (Adam): the step says a push is due; the exchange's thread takes the
  update (:meth:`HogwildReplica.take`, exact, at mini-batch boundaries), pushes it, pulls
  fresh weights and installs them (:meth:`HogwildReplica.install`, exact too) while the
  training threads go on. One exchange at a time: a push due while one is in flight joins the
  next (the update accumulates in the replica meanwhile), so a replica never waits for the
  parameter server and a busy server gets fewer, larger pushes (the replica's rate damped for
  them).
* :class:`SyncExchange` (the baseline): one training thread; the step pushes ``1/R`` of the
  update, waits until every replica of the step has pushed (the barrier), pulls and installs.
  A barrier that times out is an error naming the replicas that did not arrive.

The server is a :class:`~adam_dask.train._handle.WholePushes` (a
:class:`~adam_dask.ps.client.server.ParameterServer`, or an in-process stand-in in tests); one
with a buffer pool (:class:`~adam_dask.train._handle.PooledPushes`) takes deltas and pulls
weights in its own buffers and pulls in the push's round trip. The exchange counts what it
pushed: ``pushes``, ``images_pushed`` (images whose updates the server acknowledged) and
``items`` (per stream item, the images pushed: the replica's data position). With a :class:`~adam_dask.train._position.Marker` every push carries
its :class:`~adam_dask.ps.protocol.shard.Mark` (number, what it covers, the position after it), which the
parameter server records with it; :meth:`Exchange.push_stretch` pushes a re-trained stretch
under a given number.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ClusterError, ConfigError, UpdateRejected
from ._communicator import DueLoop
from ._handle import PooledPushes, WholePushes
from ._position import Marker, Stretch
from ._updates import Update
from .replica import HogwildReplica
from .streams import PushPace

__all__ = ["AsyncExchange", "Exchange", "SyncExchange"]

logger = logging.getLogger(__name__)


class Exchange:
    """The common part: push one :class:`Update` (scaled by ``scale``), pull, count.

    ``offsets``: offloaded layer prefix -> flat offset of its weight (for ``push_outer``);
    ``label``: who is exchanging, for error messages (e.g. ``"replica 2 in epoch 3"``).
    """

    def __init__(
        self,
        replica: HogwildReplica,
        server: WholePushes,
        *,
        scale: float = 1.0,
        label: str = "the replica",
        marker: Marker | None = None,
    ):
        self.replica = replica
        self.marker = marker
        self.server = server
        self.scale = float(scale)
        self.label = label
        self.offsets = {p: replica.net.layout[f"{p}.weight"].offset for p in replica.offload}
        self.pushes = 0
        self.pulls = 0
        self.images_pushed = 0
        self.items: dict[Any, int] = {}
        self.ps_seconds = 0.0
        # the data plane: deltas taken into the server's buffers and weights pulled into them
        # (neither copied on this side)
        self._pool = server if isinstance(server, PooledPushes) and not replica.offload else None

    def step(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> None:
        """Push what is left after training ended; raise the first error of the exchange."""
        self._push_taken(self._take())

    def close(self) -> None:
        """Release what the exchange holds after a failed training (never raises)."""

    def push_stretch(self, stretch: Stretch) -> None:
        """Push everything trained since the last push as the re-trained ``stretch`` (under its
        number; the training threads are idle), then pull and install fresh weights."""
        self._push_taken(self._take(), stretch)
        weights = self._pull()
        self.replica.install(weights)
        self._give_back(weights)

    # -- the parameter-server calls -----------------------------------------------------------------

    def _take(self, in_transit: bool = False) -> Update:
        """The replica's update, written into a buffer of the server's when it has them."""
        out = self._pool.buffer() if self._pool is not None else None
        return self.replica.take(in_transit, out=out)

    def _give_back(self, array: np.ndarray) -> None:
        """The exchange is done with ``array``, a delta or pulled weights: the server may reuse
        its buffer."""
        if self._pool is not None:
            self._pool.release(array)

    def _push_taken(self, update: Update, stretch: Stretch | None = None) -> None:
        try:
            self._push(update, stretch)
        finally:
            self._give_back(update.delta)

    def _push(
        self, update: Update, stretch: Stretch | None = None, pull: bool = False
    ) -> np.ndarray | None:
        """Push ``update``; with ``pull``, return the weights read back in the same round
        trip when the server can (``push_pull``), else None (the caller pulls)."""
        if update.empty:
            return None
        weights = None
        t = time.perf_counter()
        scale = self.scale
        prefixes = sorted(update.terms)
        marks: list = [None] * (1 + len(prefixes))
        if self.marker is not None:
            marks = self.marker.marks(update.items, 1 + len(prefixes), stretch)
        try:  # the server checks every value (NaN/Inf refused, nothing applied)
            delta = update.delta
            if scale != 1.0 and update.ticket is None:
                delta *= np.float32(scale)  # the exchange's own array: scaled in place
            elif scale != 1.0:  # the replica adds the unscaled update until it lands
                delta = delta * np.float32(scale)
            kw: dict[str, Any] = {} if marks[0] is None else {"mark": marks[0]}
            if pull and self._pool is not None and not prefixes:
                weights = self._pool.push_pull(delta, self._pool.buffer(), **kw)
                self.pulls += 1
            else:
                self.server.push(delta, **kw)
            for i, prefix in enumerate(prefixes):  # the PS computes these updates
                acts, errs = update.terms[prefix]
                extra = {} if marks[i + 1] is None else {"mark": marks[i + 1]}
                self.server.push_outer(self.offsets[prefix], errs, acts, scale=scale, **extra)
        except UpdateRejected as exc:
            raise UpdateRejected(
                f"{self.label} produced a non-finite update (the model diverged): {exc.message}",
                "lower the learning rate (--lr) or push_every",
                shard=exc.shard,
            ) from exc
        if self.marker is not None:
            self.marker.commit(marks[0])
        self.ps_seconds += time.perf_counter() - t
        self.pushes += 1
        self.images_pushed += update.images
        for k, n in update.items.items():
            self.items[k] = self.items.get(k, 0) + n
        return weights

    def _pull(self) -> np.ndarray:
        t = time.perf_counter()
        if self._pool is not None:  # into a buffer of the pool, installed, then given back
            weights = self._pool.pull(out=self._pool.buffer())
        else:
            weights = self.server.pull()
        self.ps_seconds += time.perf_counter() - t
        self.pulls += 1
        return weights


class AsyncExchange(Exchange):
    """Adam's exchange: pushes and pulls on one thread of its own
    (:class:`~adam_dask.train._communicator.DueLoop`); training never waits for it.

    :meth:`step` says a push is due; the exchange thread takes the update when it sends it, so
    a push that falls due while one is in flight joins the next one (at most one in flight).
    ``push_every`` (the paper's *k*) with ``damp``: when the pushes cover more images than
    ``push_every`` (the parameter server is busy), the replica's rate is damped by the period
    it pushed at, as a longer push period's is: :attr:`HogwildReplica.damping` from its
    :class:`~adam_dask.train.streams.PushPace` (``pace``).
    """

    def __init__(
        self,
        replica: HogwildReplica,
        server: WholePushes,
        *,
        push_every: int = 0,
        damp: bool = False,
        **kwargs: Any,
    ):
        super().__init__(replica, server, **kwargs)
        self.pace = PushPace(push_every, slack=replica.threads * replica.batch_size, damp=damp)
        self._loop = DueLoop(self._send, name="adam-exchange", on_error=lambda _: replica.stop())

    def step(self) -> None:
        """Say a push is due (never waits); raises the exchange's first error."""
        if self._loop.error is not None:
            raise self._loop.error
        self._loop.due()

    def _send(self) -> None:
        # in transit: weights pulled before the server holds it must not set the replica back
        update = self._take(in_transit=True)
        if update.empty:
            self.replica.landed(update)
            self._give_back(update.delta)
            return
        weights = self._push(update, pull=True)  # one round trip on the data plane
        self.replica.landed(update)
        self._give_back(update.delta)
        if weights is None:
            weights = self._pull()
        self.replica.install(weights)
        self._give_back(weights)
        self._pace(update.images)

    def _pace(self, images: int) -> None:
        damping = self.pace.pushed(images)
        if self.pace.damp:
            self.replica.damping = damping

    def finish(self) -> None:
        """Wait for the push in flight, push the rest; raise the first error."""
        self._loop.close()
        if self._loop.error is not None:
            raise self._loop.error
        super().finish()

    def close(self) -> None:
        try:
            self._loop.close()
        except BaseException:  # pragma: no cover - best effort after a training error
            logger.debug("exchange thread did not stop cleanly", exc_info=True)
        if self._loop.error is not None:
            logger.debug("exchange error after a training error: %r", self._loop.error)


class SyncExchange(Exchange):
    """The synchronous baseline's exchange (one training thread).

    ``wait()`` blocks until every replica of the current step has pushed and returns the
    barrier's answer ``{"ok": bool, "missing": [replicas], "generation": int, "timeout": s}``
    (:class:`~adam_dask.train.task.SyncBarrier`); ``ok`` False raises :class:`ClusterError`.
    """

    def __init__(
        self,
        replica: HogwildReplica,
        server: WholePushes,
        *,
        wait: Callable[[], dict],
        **kwargs: Any,
    ):
        if replica.threads != 1:
            raise ConfigError(
                f"a synchronous replica runs one thread, not {replica.threads}",
                "build the replica with threads=1",
            )
        super().__init__(replica, server, **kwargs)
        self._wait = wait

    def step(self) -> None:
        self._push_taken(self._take())
        answer = self._wait()
        if not answer.get("ok"):
            raise barrier_timeout(answer, self.label)
        weights = self._pull()
        self.replica.install(weights)
        self._give_back(weights)


def barrier_timeout(answer: dict, label: str) -> ClusterError:
    """The error of a synchronous step whose barrier timed out."""
    missing = answer.get("missing") or []
    who = ", ".join(str(r) for r in missing) or "unknown"
    return ClusterError(
        f"synchronous step {answer.get('generation')}: {label} waited "
        f"{answer.get('timeout')} s for replica(s) {who}, which never pushed (their TRAIN "
        "worker is frozen, overloaded or lost)",
        "check those workers, raise adam.train.sync-timeout, or train with mode='async', "
        "which does not wait for stragglers",
    )
