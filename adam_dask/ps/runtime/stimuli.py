"""Where the runtimes' events come from, named: a stimulus id per real stimulus (a timer, a
heartbeat, a push, a worker Dask added), as Dask names its own (``f"{name}-{time()}"``), and
whether to check the machines' invariants after every event (``adam.ps.validate``)."""

from __future__ import annotations

import time

from ... import config

__all__ = ["stimulus", "validating"]


def stimulus(name: str) -> str:
    """A new stimulus id for ``name``: unique enough to tell causes apart in a story."""
    return f"adam-ps-{name}-{time.time():.6f}"


def validating() -> bool:
    """Whether the runtimes check their machine's invariants after every event."""
    return bool(config.get("ps.validate"))
