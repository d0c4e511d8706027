"""A PS node's write-back to the checkpoint: blocks written in a thread, reported to the
controller (which names them in the manifest only when the writer's generation is current),
refused blocks deleted; a failure is retried after a back-off and nothing is dropped. The
outcome goes back to the node's state machine as :class:`WriteDone` or :class:`WriteFailed`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..._secrets import process_redactor
from ..checkpoint import BlockStore
from ..protocol.messages import Event, WriteDone, WriteFailed
from ..protocol.replies import ReportReply
from ..protocol.shard import ShardCopy
from .background import spawn

logger = logging.getLogger(__name__)

__all__ = ["WriteBack"]


class WriteBack:
    """The checkpoint writes of one node (``handle``: how their outcomes reach its state
    machine)."""

    def __init__(
        self,
        server_id: str,
        worker: Any,
        cfg: dict,
        handle: Callable[[Event], None],
    ) -> None:
        self.server_id, self.worker, self.cfg, self.handle = server_id, worker, cfg, handle
        self.store = BlockStore(cfg["checkpoint"], cfg.get("storage_options"))
        self.retry_at = 0.0
        self.failures = 0
        self.last_write = time.time()

    def due(self) -> bool:
        """Whether a write may start now (not within a failure's back-off)."""
        return time.monotonic() >= self.retry_at

    async def write(self, snaps: tuple[ShardCopy, ...], stimulus_id: str = "") -> None:
        """Write ``snaps`` to the checkpoint and report them to the controller; the outcome
        goes back to the node's machine as :class:`WriteDone` or :class:`WriteFailed`, caused
        by ``stimulus_id`` (the write's)."""
        try:
            paths = await asyncio.to_thread(lambda: [self.store.write(s) for s in snaps])
            reply = await asyncio.wait_for(
                self.worker.scheduler.adam_ps_written(
                    server_id=self.server_id,
                    addr=self.worker.address,
                    blocks={s.shard: [s.gen, s.version, p] for s, p in zip(snaps, paths)},
                ),
                self.cfg["call_timeout"],
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            delay = min(self.cfg["retry_base"] * 2 ** (self.failures - 1), self.cfg["retry_max"])
            self.retry_at = time.monotonic() + delay
            error = process_redactor()(f"{type(exc).__name__}: {exc}")  # shown and sent on
            logger.warning(
                "node %s: checkpoint write-back of %d shard(s) failed (attempt %d, %s); "
                "retrying in %.1fs, nothing is dropped",
                self.worker.address,
                len(snaps),
                self.failures,
                error,
                delay,
            )
            self.worker.log_event(
                "adam-ps-checkpoint",
                {"server": self.server_id, "worker": self.worker.address, "error": error},
            )
            self.handle(WriteFailed(error, stimulus_id=stimulus_id))
            return
        if self.failures:
            logger.info(
                "node %s: checkpoint write-back succeeded after %d failed attempt(s)",
                self.worker.address,
                self.failures,
            )
        self.failures = 0
        self.last_write = time.time()
        got = ReportReply.from_wire(reply)
        accepted, refused = got.accepted, got.refused
        if refused:  # a block nobody will name: remove it
            stale = [p for s, p in zip(snaps, paths) if s.shard in refused]
            spawn(asyncio.to_thread(self.store.delete, stale))
        self.handle(WriteDone(accepted, refused, stimulus_id=stimulus_id))
