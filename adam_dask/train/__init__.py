"""Training: the :class:`Trainer` driver (trainer.py), the Dask-free Hogwild engine
:class:`HogwildReplica` (replica.py) with its learning-rate :class:`Schedule` (schedule.py), and
the run's :class:`History` (metrics.py). The replica task, its exchange with the parameter server
and the epoch's bookkeeping are private modules (task.py, _pipeline.py, _stage_exchange.py, ...)."""

from __future__ import annotations

from .metrics import History
from .replica import HogwildReplica
from .schedule import Schedule
from .trainer import Trainer

__all__ = ["History", "HogwildReplica", "Schedule", "Trainer"]
