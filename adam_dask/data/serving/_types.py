"""What the serving modules share about a DataService, without importing it: a stream's
handle on one partition's server (:class:`ServerRef`) and what a stream asks of its service
(:class:`Servers`, which :class:`~adam_dask.data.serving.DataService` is). The service hands
out streams, the streams and their sources only name these types: no import cycle between
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._layout import PartitionLayout
    from ._partition import PartitionServer

__all__ = ["ServerRef", "Servers"]


@dataclass(frozen=True, slots=True)
class ServerRef:
    """Partition ``partition``'s DataServer as a stream knows it: the actor handle, its
    generation, and the address of the worker that holds it."""

    partition: int
    actor: Any
    generation: int
    address: str


class Servers(Protocol):
    """What a :class:`~adam_dask.data.serving.BatchStream` asks of its service: the layout and
    seed of the split, and each partition's server (its current generation, a replacement for
    one that failed, or a partition server in the stream's own process)."""

    @property
    def name(self) -> str: ...

    @property
    def layout(self) -> PartitionLayout: ...

    @property
    def seed(self) -> int: ...

    @property
    def local(self) -> bool: ...

    def server(self, p: int) -> ServerRef: ...

    def replacement(self, p: int, failed: ServerRef) -> ServerRef | None: ...

    def local_server(self, p: int) -> PartitionServer: ...

    def live_data_workers(self, silence: float | None = None) -> list[str] | None: ...
