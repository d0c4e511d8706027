"""Calling a method of a Dask actor by its worker address and key, from anywhere: a worker, a
client, or the scheduler (whose connection pool does not deserialize answers)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed.protocol import to_serialize
from distributed.protocol.serialize import Serialized, deserialize

logger = logging.getLogger(__name__)

__all__ = ["call_actor"]


async def call_actor(
    rpc: Any,
    addr: str,
    key: str,
    method: str,
    *args: Any,
    timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """Call ``method`` of the actor ``key`` on the worker ``addr`` through ``rpc``.

    ``rpc`` is a connection pool (``worker.rpc``, ``client.rpc``, ``scheduler.rpc``) or a
    callable returning an rpc-like object for an address (``ProxyRPC`` through the scheduler).
    Raises the actor's exception, ``OSError`` when the worker cannot be reached, and
    ``asyncio.TimeoutError`` after ``timeout`` seconds.
    """
    coro = rpc(addr).actor_execute(
        actor=key,
        function=method,
        args=[to_serialize(a) for a in args],
        kwargs={k: to_serialize(v) for k, v in kwargs.items()},
    )
    resp = await (asyncio.wait_for(coro, timeout) if timeout else coro)
    if resp["status"] == "OK":
        return _deserialized(resp["result"])
    raise _deserialized(resp["exception"])


def _deserialized(x: Any) -> Any:
    """The scheduler's connection pool does not deserialize; workers' and clients' do."""
    if isinstance(x, Serialized):
        return deserialize(x.header, x.frames)
    return x
