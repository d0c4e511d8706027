"""A stream's search for replacement DataServers, in a thread of its own: a partition the stream
serves itself (its DataServer lost, no DATA worker left to take it) gets a replacement as soon
as a DATA worker joins, while the replica trains on (starting one loads the partition: seconds
it would otherwise wait)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ._types import ServerRef, Servers

__all__ = ["ReplacementSearch"]


class ReplacementSearch:
    """At most one search per partition; :meth:`found` says how one ended, :meth:`close` ends
    them all (a replacement being started finishes on its own and stays published)."""

    def __init__(self, service: Servers, name: str, poll: float):
        self.service, self.name, self.poll = service, name, poll
        self._found: dict[int, Future] = {}
        self._wanted: set[int] = set()
        self._halt = threading.Event()
        self._pool: ThreadPoolExecutor | None = None

    def start(self, p: int, failed: ServerRef) -> None:
        """Look for a replacement of ``failed`` (partition ``p``) until one runs."""
        if p in self._found or self._halt.is_set():
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"adam-data-{self.name}")
        self._wanted.add(p)
        self._found[p] = self._pool.submit(self._replace_when_live, p, failed)

    def found(self, p: int) -> Future | None:
        """The search of partition ``p`` once it ended (its result: the replacement, or
        ``None``); ``None`` while it runs or when there is none. An ended search is forgotten."""
        fut = self._found.get(p)
        if fut is None or not fut.done():
            return None
        self.forget(p)
        return fut

    def forget(self, p: int) -> None:
        """Partition ``p`` needs no replacement any more (its server answers again)."""
        self._wanted.discard(p)
        self._found.pop(p, None)

    def close(self) -> None:
        self._halt.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _replace_when_live(self, p: int, failed: ServerRef) -> ServerRef | None:
        while p in self._wanted and not self._halt.is_set():
            ref = self.service.replacement(p, failed)
            if ref is not None:
                return ref
            self._halt.wait(self.poll)
        return None
