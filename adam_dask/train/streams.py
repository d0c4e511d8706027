"""How an epoch of R asynchronous replicas x T Hogwild threads steps: each stream's rate, the
push period and the warm-up (pure: counts and settings in, a :class:`StreamPlan` out).

Every thread of every replica is a stream of SGD steps on mini-batches of ``batch-size``
images. Many streams at once behave like one stream with a larger batch (their steps add up)
whose gradients are late: a thread's by the other T - 1 threads' steps, a replica's by what
the other R - 1 replicas pushed since it last pulled. Swept with
``benchmarks/async_sweep.py`` (the staleness of R x T emulated in one process, checked against
the CLI; ``benchmarks/results/async_sweep.jsonl``, 16-core lines of 2026-11-27 at af67077,
MNIST, 4 epochs at most, the default exponential schedule over 10):

* **The push period decides it.** 8 replicas x 1 thread at the full rate: pushing every 32
  images reached 99% after 3 epochs, every 64 ended at 97.85%, every 128 diverged; at half
  the rate every 32 took 4 epochs, every 64 ended at 98.36%. A replica's lateness grows with
  R x k and with how many replicas' deltas pile up in it, so ``push-every: auto`` is
  ``adam.train.auto-push.images / R**2`` rounded down to a power of two within
  ``[auto-push.min, auto-push.max]`` (R=1: 512, R=2: 256, R=4: 64, R=8 and more: 32).
* **A replica's threads share the rate past ``lr-streams`` of them.** Linear scaling (every
  stream at ``lr``) wins while it is stable: 8 x 1 at ``lr`` took 3 epochs where ``lr / 2``
  took 4, and the former ``lr / R`` rule ended 8 x 1 at 90.3% after 4 epochs. Past 8 threads
  of one replica the steps that add up overshoot (1 x 16 at ``lr`` diverged, at ``lr / 2``
  reached 99% in 3 epochs), so each of a replica's T threads steps ``lr x min(1, lr-streams
  / T)``.
* **Past 2 replicas, times ``sqrt(2 / R)``.** Replicas run truly side by side on a machine of
  many cores, and their pushes land later than the sweep's turn-taking lets them. On 16 cores
  (``benchmarks/results/replica_probe.jsonl``, 0a5ab28, 10 planned epochs) the rate that did
  best for each R was ``sqrt(2 / R)`` of ``lr``: 2 x 8 at ``lr`` reached 99% in 4 epochs (5 at
  ``lr / 2``); 4 x 4 at 0.71 ``lr`` in 8 (0.35: 98.77% after 10, 0.18: 98.50%, 1: 98.90%);
  8 x 2 at 0.5 ``lr`` ended at 98.55% (0.25: 98.45%, 0.125: 97.85%, 1: unstable, 96.56%).
  The former share over all R x T streams (``lr x 8 / (R T)`` too) held 8 x 2 and 4 x 4 at
  half of that. On 2 cores (``--trainers R --threads 1``) the factor is what it was.
* **A warm-up for many streams.** Replicas that start from the same weights push aligned
  deltas: ``lr-warmup: auto`` ramps the rate over ``auto-warmup`` epochs when there are more
  than 2 streams (one replica of 2 threads, a 2-core machine's default, trains as before).
* **A user's push period above the auto one is damped**: the rate times ``auto / k`` (a
  replica's lateness grows with k; 8 x 1 at ``lr`` pushing every 128 diverged), logged once.

``lr-replicas`` (not null) keeps the older rule instead: ``lr`` is the rate for that many
replicas and each of R more steps ``lr x lr-replicas / R`` (Table 1's recipe); so does a run
with replica momentum (``adam.train.momentum`` > 0), which the sweep did not cover (lr / R: a
fault test's torch run at lr 0.1 with momentum 0.9 and 2 replicas fell to 18% at the full rate).
Synchronous replicas average their deltas: rate factor 1, the configured or maximal push
period, no automatic warm-up.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Protocol

from .. import config, sizing
from .schedule import Schedule


class _Settings(Protocol):
    """What a plan reads of a run's settings (:class:`~._settings.RunSettings`)."""

    @property
    def mode(self) -> str: ...
    @property
    def push_every(self) -> int | None: ...
    @property
    def lr_streams(self) -> int | None: ...
    @property
    def lr_replicas(self) -> int | None: ...
    @property
    def lr_warmup(self) -> float | None: ...
    @property
    def momentum(self) -> float: ...


__all__ = [
    "PushPace",
    "StreamPlan",
    "auto_push_every",
    "describe",
    "plan_epoch",
    "resolve_push_every",
    "stream_plan",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """How each replica of an epoch trains (see the module docstring)."""

    replicas: int
    threads: int
    rate_factor: float
    """On every stream's rate (the schedule's)."""
    push_every: int
    """Images between a replica's pushes (the paper's k)."""
    warmup: float
    """Epochs over which the rate ramps up; 0: none."""
    damped: bool = False
    """The rate was damped for a push period above the auto one."""

    @property
    def streams(self) -> int:
        return self.replicas * self.threads

    def applied(self, base: Schedule) -> Schedule:
        """``base`` (one stream's schedule) with its rates times :attr:`rate_factor` and this
        plan's warm-up: what each replica of the epoch follows."""
        return replace(base.scaled(self.rate_factor), warmup=self.warmup)

    def as_record(self) -> dict:
        """For an epoch's history record."""
        return {
            "push_every": self.push_every,
            "rate_factor": self.rate_factor,
            "lr_warmup": self.warmup,
            "threads": self.threads,
        }


def _floor_pow2(x: float) -> int:
    n = 1
    while n * 2 <= x:
        n *= 2
    return n


def auto_push_every(replicas: int) -> int:
    """The push period for ``replicas`` asynchronous replicas (``push-every: auto``).

    >>> [auto_push_every(r) for r in (1, 2, 3, 4, 8, 16)]
    [512, 256, 64, 64, 32, 32]
    """
    images = float(config.get("train.auto-push.images"))
    lo, hi = int(config.get("train.auto-push.min")), int(config.get("train.auto-push.max"))
    return max(lo, min(hi, _floor_pow2(images / max(1, replicas) ** 2)))


class PushPace:
    """The period a replica pushes at and the rate it steps at for it.

    ``period``: images per push, smoothed over the last pushes (it starts at ``push_every``).
    A replica pushes less often than every ``push_every`` images when its exchange is busy (a
    push falling due while one is in flight joins the next); with ``damp`` (a replica among
    others) its rate is then damped as a longer push period's is: ``damping`` = ``(push_every
    + slack) / period`` at most 1, ``slack`` the images its threads have in hand at a push
    (threads x batch). Without ``damp`` (or a ``push_every``) ``damping`` stays 1.

    >>> pace = PushPace(32, slack=8, damp=True)
    >>> [round(pace.pushed(n), 3) for n in (32, 160, 160)]
    [1.0, 0.625, 0.455]
    """

    def __init__(self, push_every: int, *, slack: int, damp: bool):
        self.push_every = int(push_every)
        self.slack = int(slack)
        self.damp = bool(damp and self.push_every > 0)
        self.period = float(self.push_every)
        self.damping = 1.0

    def pushed(self, images: int) -> float:
        """A push of ``images`` left: the period follows it; the damping now."""
        if self.push_every:
            self.period += 0.25 * (images - self.period)
            if self.damp:
                self.damping = min(1.0, (self.push_every + self.slack) / max(1.0, self.period))
        return self.damping


def resolve_push_every(value: object, replicas: int) -> int:
    """A ``push-every`` setting as images: a number as it is, ``auto`` (or None) from the
    replicas (:func:`auto_push_every`)."""
    if value is None or str(value).lower() == sizing.AUTO:
        return auto_push_every(replicas)
    return int(value)  # type: ignore[call-overload]


def stream_plan(
    mode: str,
    replicas: int,
    threads: int,
    *,
    push_every: int | None,
    lr_streams: int | None,
    lr_replicas: int | None,
    lr_warmup: float | None,
    momentum: float = 0.0,
) -> StreamPlan:
    """The plan of an epoch of ``replicas`` x ``threads`` (``None``: the setting is ``auto``).

    >>> p = stream_plan("async", 8, 2, push_every=None, lr_streams=8, lr_replicas=None,
    ...                 lr_warmup=None)
    >>> p.rate_factor, p.push_every, p.warmup
    (0.5, 32, 0.5)
    >>> p = stream_plan("async", 1, 2, push_every=None, lr_streams=8, lr_replicas=None,
    ...                 lr_warmup=None)
    >>> p.rate_factor, p.push_every, p.warmup
    (1.0, 512, 0.0)
    """
    replicas, threads = max(1, int(replicas)), max(1, int(threads))
    if mode != "async":
        k = push_every if push_every is not None else int(config.get("train.auto-push.max"))
        return StreamPlan(replicas, threads, 1.0, k, lr_warmup or 0.0)
    streams = replicas * threads
    if momentum > 0 and lr_replicas is None:
        lr_replicas = 1  # the sweep ran without replica momentum: the older rule, lr / R
    if lr_replicas is not None:
        factor = min(1.0, lr_replicas / replicas)
    elif lr_streams is not None:
        factor = min(1.0, lr_streams / threads) * min(1.0, math.sqrt(2 / replicas))
    else:
        factor = 1.0
    auto_k = auto_push_every(replicas)
    k = auto_k if push_every is None else int(push_every)
    damped = lr_replicas is None and k > auto_k and replicas > 1
    if damped:
        factor *= auto_k / k
    if lr_warmup is None:
        warmup = float(config.get("train.auto-warmup")) if streams > 2 else 0.0
    else:
        warmup = float(lr_warmup)
    return StreamPlan(replicas, threads, factor, k, warmup, damped)


def plan_epoch(settings: _Settings, replicas: int, threads: int) -> StreamPlan:
    """:func:`stream_plan` from a run's settings."""
    return stream_plan(
        settings.mode,
        replicas,
        threads,
        push_every=settings.push_every,
        lr_streams=settings.lr_streams,
        lr_replicas=settings.lr_replicas,
        lr_warmup=settings.lr_warmup,
        momentum=settings.momentum,
    )


def describe(plan: StreamPlan) -> str:
    """One line for the log: what the epoch's replicas do and why."""
    text = (
        f"{plan.replicas} replica(s) x {plan.threads} thread(s): each stream at "
        f"{plan.rate_factor:.3g} x lr, a push every {plan.push_every} images, "
        f"warm-up {plan.warmup:g} epochs"
    )
    if plan.damped:
        text += (
            f" (rate damped: push_every {plan.push_every} is above the "
            f"{auto_push_every(plan.replicas)} that {plan.replicas} replicas train best with; "
            "leave push_every to auto for faster epochs)"
        )
    return text
