"""What a stream receives for one request: a batch, the end, an error, or news of its server.

A DataServer answers ``next_batch`` with one of :class:`Batch`, :class:`End`,
:class:`ServingError`, :class:`ServerClosed` or :class:`StreamExpired`; the stream itself turns a
server that does not answer (its worker died or froze) into :class:`ServerLost`. Each is a small
frozen value, so a consumer dispatches on its type (``match``) instead of on dictionary keys.

>>> import numpy as np
>>> b = Batch(k=0, x=np.zeros((2, 28, 28, 1), np.uint8), y=np.array([3, 1]), idx=np.array([7, 9]))
>>> len(b), b.k
(2, 0)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ...errors import ClusterError, DatasetError

logger = logging.getLogger(__name__)

__all__ = [
    "Batch",
    "End",
    "Message",
    "ServerClosed",
    "ServerLost",
    "ServingError",
    "StreamExpired",
]


@dataclass(frozen=True, slots=True)
class Batch:
    """Batch number ``k`` of a stream's share of one partition.

    ``x`` is either the stored pixels, uint8 (B, H, W, C) (no augmentation: a quarter of
    float32's traffic; the stream converts them with
    :func:`~adam_dask.data.augment.to_float`), or augmented float32 (B, C, H, W) in [0, 1].
    ``y`` (B,) int64 labels, ``idx`` (B,) int64 global image indices.
    """

    k: int
    x: np.ndarray
    y: np.ndarray
    idx: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True, slots=True)
class End:
    """The stream has handed out every batch it was opened for."""


@dataclass(frozen=True, slots=True)
class ServingError:
    """Making a batch failed: the store is unreadable or damaged (``url`` names it)."""

    message: str
    hint: str | None
    url: str | None

    def exception(self) -> DatasetError:
        return DatasetError(self.message, self.hint, url=self.url)


@dataclass(frozen=True, slots=True)
class ServerClosed:
    """The DataServer was shut down: its DataService was closed (final), or, with ``ending``,
    its worker's process is ending (an eviction's SIGTERM, a scale-down), which a stream
    takes as a lost server and recovers from."""

    message: str
    hint: str | None
    ending: bool = False

    def exception(self) -> ClusterError:
        return ClusterError(self.message, self.hint)


@dataclass(frozen=True, slots=True)
class StreamExpired:
    """The server is alive but does not know the stream (dropped after ``idle-timeout``)."""

    message: str


@dataclass(frozen=True, slots=True)
class ServerLost:
    """The server cannot serve the stream: its worker is gone (``"error"``), it did not answer
    a liveness probe (``"unanswered"``: frozen), or no batch came within ``call-timeout``
    (``"timeout"``). Made by the stream, never sent by a server."""

    reason: str
    cause: Literal["error", "unanswered", "timeout"]


Message = Batch | End | ServingError | ServerClosed | StreamExpired | ServerLost
