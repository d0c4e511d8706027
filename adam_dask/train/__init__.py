"""Training: the Dask-free Hogwild engine (replica.py), the replica as a long-running Dask task
(task.py), the Trainer driver (trainer.py), and history/progress/plots (metrics.py)."""

from __future__ import annotations

from .metrics import History, Progress
from .replica import HogwildReplica
from .trainer import Trainer

__all__ = ["History", "HogwildReplica", "Progress", "Trainer"]
