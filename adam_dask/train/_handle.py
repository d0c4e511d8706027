"""What training asks of the parameter server, as typed handles (structural ``Protocol``\\ s).

:class:`~adam_dask.ps.client.server.ParameterServer` is the one real implementation; tests pass
in-process stand-ins that implement the part their code under test calls. Each role asks for
the least it needs:

* :class:`WholePushes`: a whole model's push with its offloaded dense layers' terms: push a
  delta, push a dense layer's outer product.
* :class:`RangedPushes`: a stage of a replica (:mod:`._stage_exchange`): push and pull its
  span; :class:`StagePushes` with a whole model's offloaded terms too.
* :class:`ReplicaServer`: a replica's task (:mod:`._partition_task`): a stage's pushes, the
  marks it plans its start from, and the wait until its pushes are held by every copy.
* :class:`TrainerServer`: the driver (:mod:`.trainer`, :mod:`.run_state`, :mod:`._epoch_run`):
  flushes and checkpoints, figures, the routing record, the run's epoch and meta.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..errors import StorageError
from ..ps.protocol.shard import Mark

__all__ = [
    "RangedPushes",
    "ReplicaServer",
    "StagePushes",
    "TrainerServer",
    "WholePushes",
]


class WholePushes(Protocol):
    """Pushes and pulls of the whole flat parameter vector."""

    def push(self, delta: np.ndarray, *, mark: Mark | None = None) -> None:
        """Add ``delta`` (flat float32, the server's size) to the parameters."""

    def push_outer(
        self,
        offset: int,
        errors: np.ndarray,
        activations: np.ndarray,
        scale: float = 1.0,
        *,
        mark: Mark | None = None,
    ) -> None:
        """Add ``scale * errors.T @ activations`` to the parameters from ``offset`` on."""

    def pull(self) -> np.ndarray:
        """The current flat parameters."""


class RangedPushes(Protocol):
    """Pushes and pulls of a span ``[start, stop)`` of the parameters."""

    def pull_range(self, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """The parameters ``[start, stop)``, written into ``out`` when given."""

    def push_range(
        self,
        values: np.ndarray,
        start: int,
        *,
        mark: Mark | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Add ``values`` to the parameters ``[start, start + len(values))``; with ``out``,
        read that span back into it after the push, in one round trip."""


class StagePushes(WholePushes, RangedPushes, Protocol):
    """A stage of the pipeline (:mod:`._stage_exchange`): its span's pushes and pulls, and a
    whole model's push with its offloaded dense layers' terms."""


class ReplicaServer(StagePushes, Protocol):
    """What a replica task asks of the parameter server."""

    def marks(self, epoch: int) -> dict[int, dict[int, tuple[Mark, ...]]]:
        """``{shard: {replica: the marks of its pushes of epoch the shard applied}}``."""

    def settle(self, timeout: float | None = None, *, checkpoint: bool = True) -> None:
        """Block until every push of this handle is held by every copy (and the checkpoint)."""

    def held(self) -> dict:
        """``{"pushes", "bytes", "unreplicated"}``: what this handle holds for replay."""


class TrainerServer(ReplicaServer, Protocol):
    """What the training driver asks of the parameter server besides a replica's calls."""

    epoch: Any  # the last epoch the manifest recorded (None before the first)
    meta: dict  # the run's record in the manifest
    checkpoint: str | None  # where the shards are written back (None: nowhere)

    def flush(
        self,
        epoch: Any = None,
        *,
        meta: dict | None = None,
        timeout: float | None = None,
        copies_only: bool = False,
    ) -> dict[int, int]:
        """Block until every copy (and the checkpoint) holds every acknowledged push."""

    def storage_error(self, exc: BaseException) -> StorageError:
        """An error naming the checkpoint's storage as the cause of ``exc``."""

    def stats(self) -> dict:
        """Figures from the controller, every node and this handle."""

    def routing_info(self) -> dict:
        """The controller's record: routing, generations, nodes, losses, heal times."""

    def close(self) -> None:
        """Stop the nodes (the checkpoint stays)."""
