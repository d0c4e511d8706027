"""A PS node's forwards to its backups: one at a time per backup, over the data plane where it
reaches the backup (in threads of its own: a frozen backup holds one for up to the call
timeout), else as a Dask actor call; a failure is retried after a back-off, during which the
backup stays busy and nothing else is sent to it. The outcome goes back to the node's state
machine as :class:`ForwardDone` or :class:`ForwardFailed`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...net.tls import connect_context
from ..plane.forward import ForwardChannels
from ..protocol.messages import Event, Forward, ForwardDone, ForwardFailed
from ..protocol.replies import ReplicateReply
from .background import spawn
from .rpc import call_actor

logger = logging.getLogger(__name__)

__all__ = ["Forwarder"]


class Forwarder:
    """The forwards of one node (``handle``: how their outcomes reach its state machine)."""

    def __init__(
        self, server_id: str, worker: Any, cfg: dict, handle: Callable[[Event], None]
    ) -> None:
        self.worker, self.cfg, self.handle = worker, cfg, handle
        self.tasks: dict[str, asyncio.Task] = {}  # backup -> its forward on the way
        self.failures = 0
        self.channels: ForwardChannels | None = None
        self.pool: ThreadPoolExecutor | None = None
        mode = str(cfg.get("data_plane", "auto"))
        if mode != "dask":
            tls = connect_context() if worker.address.startswith("tls://") else None
            self.channels = ForwardChannels(server_id, mode, cfg["call_timeout"], tls)
            self.pool = ThreadPoolExecutor(8, thread_name_prefix="adam-forward")

    def start(self, a: Forward) -> None:
        self.tasks[a.addr] = spawn(self._forward(a))

    def cancel(self, addr: str) -> None:
        task = self.tasks.pop(addr, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        if self.channels is not None:
            self.channels.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def counts(self) -> dict | None:
        """What went on the data plane (None: the plane is off)."""
        return dict(self.channels.counts) if self.channels is not None else None

    async def _forward(self, a: Forward) -> None:
        try:
            got = await self._on_plane(a)
            if got is None:  # the Dask way
                wire = await call_actor(
                    self.worker.rpc,
                    a.addr,
                    a.key,
                    "replicate",
                    list(a.snaps),
                    self.worker.address,
                    timeout=self.cfg["call_timeout"],
                )
                got = ReplicateReply.from_wire(wire)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            delay = min(
                self.cfg["retry_base"] * 2 ** (self.failures - 1), self.cfg["forward_retry_max"]
            )
            logger.warning(
                "node %s: forwarding %d shard(s) to backup %s failed (%s: %s); retrying in %.1fs",
                self.worker.address,
                len(a.snaps),
                a.addr,
                type(exc).__name__,
                exc,
                delay,
            )
            await asyncio.sleep(delay)  # the backup stays busy meanwhile: nothing else is sent
            if self.tasks.get(a.addr) is asyncio.current_task():
                self.tasks.pop(a.addr, None)
                why = f"{type(exc).__name__}: {exc}"
                self.handle(ForwardFailed(a.addr, why, stimulus_id=a.stimulus_id))
            return
        self.failures = 0
        if self.tasks.get(a.addr) is asyncio.current_task():
            self.tasks.pop(a.addr, None)
        done = ForwardDone(a.addr, got.held, got.refused, a.key, stimulus_id=a.stimulus_id)
        self.handle(done)

    async def _on_plane(self, a: Forward) -> ReplicateReply | None:
        """The forward ``a`` over the data plane, in a thread (:mod:`..plane.forward`); None
        when the plane can not carry it."""
        fc = self.channels
        if fc is None:
            return None
        if not fc.knows(a.addr, a.key):
            try:
                ep = await call_actor(
                    self.worker.rpc, a.addr, a.key, "plane", timeout=self.cfg["call_timeout"]
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.debug("node %s: no data plane of %s (%r)", self.worker.address, a.addr, exc)
                return None
            fc.remember(a.addr, a.key, ep)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.pool, fc.forward, a.addr, a.key, self.worker.address, a.snaps
        )
