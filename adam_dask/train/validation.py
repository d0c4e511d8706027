"""What a run checks its weights against: the held-out images, and the tail average of the
weights validated beside them.

:class:`Validation` belongs to a :class:`~adam_dask.train.trainer.Trainer`: it reads the test
split once (or, for a store without one, the first ``adam.train.validation-images`` training
images), scores a network on it, and keeps the run's :class:`~._average.TailAverage`, storing
it beside the checkpoint after each averaged epoch so a resumed run goes on with it. No Dask:
the Trainer pulls the weights and hands them over.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import config
from ..data.augment import to_float
from ..errors import ConfigError, DatasetError
from ._average import TailAverage
from .run_state import save_average

logger = logging.getLogger(__name__)

__all__ = ["Validation", "calibration_images"]


def calibration_images(train_split: Any) -> np.ndarray:
    """The first ``adam.model.calibration-images`` images of ``train_split`` (unaugmented,
    float32 in [0, 1]): what the population statistics of bn layers are recomputed from."""
    n = min(int(config.get("model.calibration-images")), len(train_split))
    return to_float(train_split.read(0, n)[0])


class Validation:
    """The held-out images of the store at ``data`` and the run's tail average."""

    def __init__(self, data: str, train_split: Any, storage_options: dict | None):
        from ..data.datasets import open_split

        self.train_split = train_split
        self.storage_options = storage_options
        self.test_split: Any = None
        try:
            self.test_split = open_split(data, "test", storage_options)
        except DatasetError:
            logger.warning(
                "%s has no test split: validating on the first %d training images",
                data,
                int(config.get("train.validation-images")),
            )
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._calibration: np.ndarray | None = None
        self.average: TailAverage | None = None  # set by plan_average when averaging is on

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The validation images, (N, H, W[, C]) float32 in [0, 1], and their labels."""
        if self._arrays is None:
            if self.test_split is not None:
                x, y = self.test_split.read()
            else:
                n = int(config.get("train.validation-images"))
                x, y = self.train_split.read(0, min(n, len(self.train_split)))
            self._arrays = (to_float(x), y)
        return self._arrays

    def accuracy(self, net: Any, data: str | None = None, split: str = "test") -> float:
        """Top-1 accuracy of ``net`` on the validation images, or on split ``split`` of the
        store at ``data``. A network with bn layers is first calibrated (:meth:`calibrate`) on
        the training images, since its weights changed since the last time."""
        self.calibrate(net)
        if data is None:
            x, y = self.arrays()
        else:
            from ..data.datasets import open_split

            x, y = open_split(data, split, self.storage_options).read()
            x = to_float(x)
        return float(net.evaluate(x, y))

    def calibrate(self, net: Any) -> None:
        """Recompute the population statistics of ``net``'s bn layers (none: nothing to do)
        from :func:`calibration_images` of the training split, read once per run."""
        if net.batch_norm:
            if self._calibration is None:
                self._calibration = calibration_images(self.train_split)
            net.calibrate(self._calibration)

    # -- the tail average ------------------------------------------------------------------------

    def plan_average(self, average_from: float | None, epochs: int) -> None:
        """Average from ``average_from`` of ``epochs`` on (None: no averaging); an average
        already under way (a resumed run) is kept when it starts at the same epoch."""
        if average_from is None:
            return
        start = TailAverage.planned(average_from, epochs).start_epoch
        if self.average is None or self.average.start_epoch != start:
            self.average = TailAverage(start_epoch=start)

    def add_epoch(self, epoch: int, net: Any, checkpoint: str | None) -> tuple[float, int] | None:
        """Take epoch ``epoch``'s weights (those ``net`` holds) into the tail average, store
        it beside ``checkpoint``, and validate it: ``(accuracy, epochs averaged)``, or None
        outside the averaged epochs."""
        if self.average is None or not self.average.add(epoch, net.flat):
            return None
        if checkpoint:
            try:
                save_average(checkpoint, self.average, self.storage_options)
            except Exception as exc:  # the mean stays in memory: only a resume would miss it
                logger.warning(
                    "could not store the weight average in %s (%s); training goes on, and a "
                    "run resumed from there averages anew",
                    checkpoint,
                    exc,
                )
        return self.accuracy(self.averaged(net)), self.average.count

    def averaged(self, net: Any) -> Any:
        """A copy of ``net`` holding the tail average of the weights."""
        if self.average is None or not self.average.count:
            raise ConfigError(
                "no weights have been averaged yet",
                "set average_from= (adam.train.average-from) and train into the averaged epochs",
            )
        return self.average.applied_to(net)
