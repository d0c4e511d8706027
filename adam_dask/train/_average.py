"""Tail averaging of a run's weights: the mean of the parameter server's weights at the end of
each epoch from a point of the run on (Polyak-Ruppert averaging at epoch granularity, as in
stochastic weight averaging, Izmailov et al. 2018).

Training is untouched: the replicas and the parameter server go on with their own weights; the
average is what the Trainer evaluates beside them (``average_accuracy`` in the history) and what
:meth:`Trainer.averaged_network` returns. Off unless ``adam.train.average-from`` is set.

Pure: no Dask, no I/O.

>>> import numpy as np
>>> avg = TailAverage.planned(average_from=0.5, epochs=4)
>>> avg.start_epoch
2
>>> [avg.add(e, np.full(2, float(e), np.float32)) for e in range(4)]
[False, False, True, True]
>>> avg.weights().tolist(), avg.epochs
([2.5, 2.5], [2, 3])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["TailAverage", "check_average_from"]


def check_average_from(value: float) -> None:
    """The one check of the setting: a fraction of the planned epochs in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ConfigError(
            f"average_from={value} must lie in [0, 1)",
            "set average_from= or adam.train.average-from to a fraction of the planned "
            "epochs (0.5: average the second half), or null for no averaging",
        )


@dataclass(slots=True)
class TailAverage:
    """The running mean of the end-of-epoch weights of epochs ``start_epoch`` (0-based) on."""

    start_epoch: int
    epochs: list[int] = field(default_factory=list)
    """The epochs whose weights are in the mean, in order."""
    _sum: np.ndarray | None = None  # float64: a mean of many float32 arrays loses no digits

    @classmethod
    def planned(cls, average_from: float, epochs: int) -> TailAverage:
        """Average the epochs from ``average_from`` (a fraction in [0, 1) of the ``epochs``
        planned) to the end: 0.5 over a 30-epoch run averages epochs 16 to 30."""
        check_average_from(average_from)
        return cls(start_epoch=min(math.floor(average_from * epochs), epochs - 1))

    @property
    def count(self) -> int:
        return len(self.epochs)

    def add(self, epoch: int, weights: np.ndarray) -> bool:
        """Take the weights at the end of ``epoch`` into the mean if the epoch is in the tail
        (once: an epoch already in the mean is skipped). Returns whether they were taken."""
        if epoch < self.start_epoch or epoch in self.epochs:
            return False
        w = np.asarray(weights, dtype=np.float64)
        if self._sum is None:
            self._sum = w.copy()
        elif self._sum.shape != w.shape:
            raise ValueError(f"weights of shape {w.shape}, the average holds {self._sum.shape}")
        else:
            self._sum += w
        self.epochs.append(int(epoch))
        return True

    def weights(self) -> np.ndarray:
        """The mean (float32, like ``Network.flat``); an error before any epoch is in."""
        if self._sum is None:
            raise ValueError("no epoch is in the average yet")
        return (self._sum / self.count).astype(np.float32)

    def applied_to(self, net: Any) -> Any:
        """A copy of the Network ``net`` holding the mean instead of its own weights."""
        out = net.copy()
        out.flat = self.weights()
        return out

    def state(self) -> tuple[np.ndarray | None, dict]:
        """``(sum, attributes)`` to store: the float64 sum and the epochs it holds."""
        return self._sum, {"start_epoch": self.start_epoch, "epochs": list(self.epochs)}

    @classmethod
    def from_state(cls, total: np.ndarray | None, attrs: dict) -> TailAverage:
        out = cls(start_epoch=int(attrs["start_epoch"]), epochs=[int(e) for e in attrs["epochs"]])
        if out.epochs:
            if total is None:
                raise ValueError("a stored average lists epochs but holds no weights")
            out._sum = np.asarray(total, dtype=np.float64).copy()
        return out
