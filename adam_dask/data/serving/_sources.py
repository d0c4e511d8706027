"""Where a :class:`~._stream.BatchStream` gets a partition's batches from: a DataServer actor on
a DATA worker (:class:`ActorSource`, which notices a frozen server by probing it) or a
partition server in the consumer's own process (:class:`LocalSource`, the last resort)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import config
from ...errors import AdamError
from ._messages import Message, ServerLost
from ._partition import PartitionServer
from ._types import ServerRef

if TYPE_CHECKING:
    from tornado.ioloop import IOLoop

logger = logging.getLogger(__name__)

__all__ = ["ActorSource", "LocalSource", "Remote", "Source", "Timing"]


@dataclass(frozen=True, slots=True)
class Timing:
    call_timeout: float
    probe_after: float
    probe_timeout: float
    return_interval: float

    @classmethod
    def from_config(cls) -> Timing:
        return cls(
            call_timeout=float(config.get("serving.call-timeout")),
            probe_after=float(config.get("serving.probe-after")),
            probe_timeout=float(config.get("serving.probe-timeout")),
            return_interval=float(config.get("serving.return-interval")),
        )


class Remote:
    """Actor calls made from the consumer's thread, each a :class:`concurrent.futures.Future`
    that Dask's event loop completes. Reading a finished one costs no trip through the event
    loop (``ActorFuture.result`` always makes one, ~1 ms from a task thread), and waiting on
    one with a timeout leaves the call running."""

    def __init__(self) -> None:
        from distributed import get_client, get_worker

        loop: IOLoop | None
        try:  # in a task: the worker's loop, which its actor handles use
            loop = get_worker().loop
        except ValueError:
            loop = get_client().loop
        assert loop is not None, "a running client has an event loop"
        self._loop = loop

    def call(self, actor: Any, method: str, *args: Any) -> Future:
        out: Future = Future()

        async def run() -> None:
            if not out.set_running_or_notify_cancel():
                return
            try:
                out.set_result(await getattr(actor, method)(*args))
            except BaseException as exc:  # handed to the consumer, which decides
                out.set_exception(exc)

        self._loop.add_callback(run)
        return out


class ActorSource:
    """Stream ``sid`` on a DataServer actor."""

    def __init__(self, ref: ServerRef, sid: str, remote: Remote, timing: Timing):
        self.ref, self.sid, self.remote, self.timing = ref, sid, remote, timing

    def request(self) -> Future:
        return self.remote.call(self.ref.actor, "next_batch", self.sid)

    def wait(self, call: Future) -> Any:
        """The call's answer, or :class:`ServerLost` when the server's worker is gone, does
        not answer a probe, or gives no answer within ``call-timeout``."""
        t = self.timing
        start = time.monotonic()
        while True:
            try:
                return call.result(timeout=t.probe_after)
            except TimeoutError:
                pass
            except AdamError:
                raise
            except Exception as exc:
                return ServerLost(f"{type(exc).__name__}: {exc}", "error")
            if not self.alive():
                call.cancel()
                return ServerLost(
                    f"its worker {self.ref.address} did not answer a ping within "
                    f"{t.probe_timeout} s (frozen?)",
                    "unanswered",
                )
            if time.monotonic() - start > t.call_timeout:
                call.cancel()
                return ServerLost(
                    f"no answer within {t.call_timeout} s (adam.serving.call-timeout)", "timeout"
                )

    def alive(self) -> bool:
        """Whether the server answers a ping within ``probe-timeout``."""
        ping = self.remote.call(self.ref.actor, "ping")
        try:
            ping.result(timeout=self.timing.probe_timeout)
            return True
        except Exception:
            ping.cancel()
            return False

    def close(self) -> None:
        try:  # fire and forget: a frozen server gets it when it wakes
            self.remote.call(self.ref.actor, "close_stream", self.sid)
        except RuntimeError:  # the event loop is closed: the process is shutting down
            pass


class LocalSource:
    """Stream ``sid`` on a partition server in this process (the last resort)."""

    def __init__(self, server: PartitionServer, sid: str, timing: Timing, lost: ServerRef | None):
        self.server, self.sid, self.timing = server, sid, timing
        self.lost = lost  # the DataServer this replaces (None: the service serves locally)
        self.next_check = time.monotonic() + timing.return_interval

    def request(self) -> Future:
        return Future()  # a placeholder: wait() takes the batch from the server

    def wait(self, call: Future) -> Message:
        try:
            return self.server.take(self.sid, self.timing.call_timeout)
        except TimeoutError as exc:
            return ServerLost(str(exc), "timeout")

    def close(self) -> None:
        self.server.close()


Source = ActorSource | LocalSource
