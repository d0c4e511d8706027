"""The learning-rate schedule: one function of the run's progress, relative to the planned epochs.

A run plans ``epochs`` epochs; the rate starts at ``lr`` and reaches ``lr * floor`` when the plan
ends, whatever its length, so a 5-epoch and a 50-epoch run both anneal fully. Progress is
counted in epochs and may be fractional: a replica moves its rate at every push (its share's
images done / share size), so even a one-epoch run anneals. An early stop
(``target_accuracy``) simply ends the run part-way; past the plan the rate stays at the floor.

Shapes (``kind``, config ``adam.train.lr-schedule``), with ``p = progress / epochs`` in [0, 1]:

* ``cosine``: ``lo + (lr - lo) * (1 + cos(pi p)) / 2`` (``lo = lr * floor``);
* ``linear``: ``lr - (lr - lo) * p``;
* ``exponential``: ``lr * floor ** p`` (a constant factor per epoch, fitted to the plan);
* ``constant``: ``lr`` throughout (``floor`` is ignored).

A warm-up (``warmup`` epochs, config ``adam.train.lr-warmup``; 0 = none) ramps the rate linearly
from ``lo`` (``lr * floor``) up to the shape's rate over the run's first ``warmup`` epochs:
asynchronous replicas that all start from the same weights add their deltas, and at full rate
those early, aligned steps overshoot (the measurements are beside the setting in adam.yaml).

Pure: no Dask, no clocks; the replica (:class:`~adam_dask.train.replica.HogwildReplica`), the
replica task and the Trainer all use this one definition.

>>> s = Schedule(lr=0.1, epochs=10, kind="linear", floor=0.0)
>>> s.at(0), round(s.at(5), 6), s.at(10), s.at(12)
(0.1, 0.05, 0.0, 0.0)
>>> round(Schedule(lr=0.1, epochs=2, kind="exponential", floor=0.25).at(1), 6)
0.05
>>> w = Schedule(lr=0.1, epochs=10, kind="constant", floor=0.1, warmup=1.0)
>>> round(w.at(0), 6), round(w.at(0.5), 6), w.at(1)
(0.01, 0.055, 0.1)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .. import config, sizing
from ..errors import ConfigError

__all__ = ["KINDS", "Schedule"]

KINDS = ("cosine", "linear", "exponential", "constant")


@dataclass(frozen=True, slots=True)
class Schedule:
    """The learning rate over a run of ``epochs`` planned epochs (see the module docstring)."""

    lr: float
    """The rate at the start of the run."""
    epochs: int
    """The planned length of the run, in epochs; the rate reaches the floor at its end."""
    kind: str
    """``cosine``, ``linear``, ``exponential`` or ``constant``."""
    floor: float
    """The final rate as a fraction of ``lr`` (in [0, 1]; > 0 for ``exponential``)."""
    warmup: float = 0.0
    """Epochs over which the rate ramps up from ``lr * floor`` to the shape's rate; 0: none."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr={self.lr} must be positive", "set lr= or adam.train.lr")
        if self.epochs < 1:
            raise ConfigError(f"epochs={self.epochs} must be at least 1", "plan one epoch or more")
        if self.kind not in KINDS:
            raise ConfigError(
                f"lr schedule {self.kind!r} is not one of {', '.join(KINDS)}",
                "set lr_schedule= or adam.train.lr-schedule",
            )
        if not 0.0 <= self.floor <= 1.0 or (self.kind == "exponential" and self.floor <= 0):
            raise ConfigError(
                f"lr floor {self.floor} must lie in {'(0' if self.kind == 'exponential' else '[0'}"
                ", 1] for the schedule {self.kind!r}",
                "set lr_floor= or adam.train.lr-floor",
            )
        if not (math.isfinite(self.warmup) and self.warmup >= 0):
            raise ConfigError(
                f"lr warm-up {self.warmup} must be a number of epochs >= 0",
                "set lr_warmup= or adam.train.lr-warmup (0 for none)",
            )

    @classmethod
    def from_config(
        cls,
        lr: float | None = None,
        epochs: int | None = None,
        kind: str | None = None,
        floor: float | None = None,
        warmup: float | None = None,
    ) -> Schedule:
        """A schedule with each argument left as None taken from ``adam.train.*``."""
        return cls(
            lr=float(config.get("train.lr", lr)),
            epochs=int(config.get("train.epochs", epochs)),
            kind=str(config.get("train.lr-schedule", kind)),
            floor=float(config.get("train.lr-floor", floor)),
            warmup=_warmup(config.get("train.lr-warmup", warmup)),
        )

    def at(self, progress: float) -> float:
        """The rate after ``progress`` epochs of the run (fractional; clamped to the plan)."""
        progress = max(float(progress), 0.0)
        rate = self._shape(min(progress / self.epochs, 1.0))
        if progress < self.warmup:
            low = self.lr * self.floor
            return low + (rate - low) * progress / self.warmup
        return rate

    def _shape(self, p: float) -> float:
        low = self.lr * self.floor
        if self.kind == "cosine":
            return low + (self.lr - low) * 0.5 * (1.0 + math.cos(math.pi * p))
        if self.kind == "linear":
            return self.lr - (self.lr - low) * p
        if self.kind == "exponential":
            return self.lr * self.floor**p
        return self.lr

    def scaled(self, factor: float) -> Schedule:
        """The same schedule with every rate times ``factor`` (the floor and warm-up are
        fractions and epochs, so they keep their meaning)."""
        return Schedule(self.lr * factor, self.epochs, self.kind, self.floor, self.warmup)

    def replan(self, epochs: int) -> Schedule:
        """The same schedule over ``epochs`` planned epochs."""
        return Schedule(self.lr, int(epochs), self.kind, self.floor, self.warmup)

    def to_dict(self) -> dict:
        """JSON-safe, for a checkpoint's manifest."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        return cls(
            float(d["lr"]),
            int(d["epochs"]),
            str(d["kind"]),
            float(d["floor"]),
            float(d.get("warmup", 0.0)),  # manifests written before the warm-up existed
        )


def _warmup(value: object) -> float:
    """A warm-up setting as epochs: ``auto`` is a lone replica's, none (for a cluster's epochs
    :func:`~adam_dask.train.streams.stream_plan` decides it from the replicas and threads)."""
    return 0.0 if str(value).lower() == sizing.AUTO else float(value)  # type: ignore[arg-type]
