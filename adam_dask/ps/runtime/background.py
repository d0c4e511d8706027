"""Background tasks of the PS nodes on a worker's event loop, kept alive until done (asyncio
keeps only a weak reference to a task)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["every", "spawn"]

logger = logging.getLogger(__name__)

_tasks: set[asyncio.Task] = set()


def spawn(coro: Any) -> asyncio.Task:
    """Run ``coro`` in the background of the running loop; the task is kept until done."""
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def every(
    seconds: float, fn: Callable[[], Awaitable[None]], running: Callable[[], bool], who: str
) -> None:
    """Await ``fn()`` every ``seconds`` while ``running()``; a failure is logged (as ``who``'s)
    and the timer goes on."""
    while running():
        await asyncio.sleep(float(seconds))
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a timer must keep running
            logger.exception("%s: %s failed", who, getattr(fn, "__name__", fn))
