"""Background tasks of the PS nodes on a worker's event loop, kept alive until done (asyncio
keeps only a weak reference to a task)."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["spawn"]

_tasks: set[asyncio.Task] = set()


def spawn(coro: Any) -> asyncio.Task:
    """Run ``coro`` in the background of the running loop; the task is kept until done."""
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task
