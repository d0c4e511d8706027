"""How a :class:`~adam_dask.ps.server.ParameterServer` handle reaches the nodes: the cached
routing, calls to the primaries with retries across fail-overs, and the replay of held pushes.

The routing lives in the scheduler plugin; a handle keeps a copy and reads it again whenever a
node does not answer, says a shard moved (its stamp, the shard's generation, is not the node's),
or the controller drops the node it waits for (a frozen node never answers; waiting for the call
timeout would stall training). Calls run on the worker's event loop inside a Dask task, or on the
client's otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .. import config
from ..errors import ConfigError, ShardUnavailable, StorageError, UpdateRejected
from ._replay import ReplayLog
from ._rpc import call_actor

logger = logging.getLogger(__name__)

__all__ = ["Transport"]


class Transport:
    """The call machinery of a parameter-server handle (mixed into ParameterServer)."""

    server_id: str
    shards: list[tuple[int, int]]
    _client: Any
    _closed: bool
    _log: ReplayLog
    _settler: asyncio.Task | None
    _channels: Any
    _plane_answered: float

    def _init_transport(self) -> None:
        self._routing: list[list[str]] = []
        self._gens: list[int] = []
        self._nodes: dict[str, str] = {}
        self._pending: set[int] = set()
        self._lost: set[int] = set()
        self._generation = -1
        self._healthy = False
        self._log = ReplayLog()
        self._settler = None
        self._channels = None
        self._plane_answered = -1e9  # monotonic time of the last data-plane push answered

    # -- execution context -----------------------------------------------------------------------

    def _context(self) -> tuple[Any, Any, Any]:
        """(run, rpc, scheduler): how to run a coroutine here, reach a worker, reach the
        scheduler; a worker's own when called inside a task, else the client's."""
        from distributed import get_worker
        from distributed.actor import ProxyRPC
        from distributed.utils import sync

        try:
            worker = get_worker()
        except ValueError:
            worker = None
        if worker is not None:
            return (lambda f, *a, **k: sync(worker.loop, f, *a, **k)), worker.rpc, worker.scheduler
        client = self._client
        if client is None:
            from distributed import default_client

            client = self._client = default_client()
        if client.direct_to_workers:
            rpc = client.rpc
        else:

            def rpc(addr: str) -> ProxyRPC:
                return ProxyRPC(client.scheduler, addr)

        return client.sync, rpc, client.scheduler

    def _run(self, coro_fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ShardUnavailable(f"parameter server {self.server_id} is closed")
        run, rpc, sched = self._context()
        return run(coro_fn, rpc, sched, *args, **kwargs)

    # -- routing ---------------------------------------------------------------------------------

    def _set_routing(self, r: dict) -> None:
        self._routing = [list(h) for h in r["routing"]]
        self._gens = [int(g) for g in r["gens"]]
        self._nodes = dict(r["nodes"])
        self._pending = set(r["pending"])
        self._lost = set(r["lost"])
        self._generation = r["generation"]
        self._healthy = r["healthy"]

    async def _refresh(self, sched: Any) -> None:
        self._set_routing(await sched.adam_ps_routing(server_id=self.server_id))

    def _stamps(self, sids: Iterable[int]) -> dict[int, int]:
        """{sid: generation} as this handle knows them: a node refuses older ones."""
        return {s: self._gens[s] for s in sids}

    def _primary_of(self) -> dict[int, tuple[str, int]]:
        """{sid: (primary address, generation)} of the shards that have a primary now."""
        return {
            s: (h[0], self._gens[s])
            for s, h in enumerate(self._routing)
            if h and s not in self._pending and s not in self._lost
        }

    async def _primaries(
        self, sched: Any, sids: Iterable[int], deadline: float
    ) -> dict[str, list[int]]:
        """{primary addr: [sid, ...]} for ``sids``, waiting while some shard has no primary."""
        sids = list(sids)
        delay = 0.02
        while True:
            lost = [s for s in sids if s in self._lost]
            if lost:
                raise ShardUnavailable(
                    f"every copy of shard {lost[0]} of server {self.server_id} is lost and "
                    "there is no checkpoint to rebuild it from",
                    "create the server with checkpoint=URL",
                    shard=lost[0],
                )
            if not any(s in self._pending or not self._routing[s] for s in sids):
                out: dict[str, list[int]] = {}
                for s in sids:
                    out.setdefault(self._routing[s][0], []).append(s)
                return out
            if time.monotonic() > deadline:
                s = next(s for s in sids if s in self._pending or not self._routing[s])
                raise ShardUnavailable(
                    f"shard {s} of server {self.server_id} has no primary "
                    "after the fail-over timeout",
                    "check the PS workers (adam.ps.failover-timeout)",
                    shard=s,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            await self._refresh(sched)

    async def _each_primary(
        self,
        rpc: Any,
        sched: Any,
        sids: Iterable[int],
        method: str,
        make_args: Callable[[list[int]], tuple],
        call_timeout: float | None = None,
        on_reply: Callable[[str, dict], None] | None = None,
        **kwargs: Any,
    ) -> dict[int, Any]:
        """Call ``method`` on the primary of every shard in ``sids`` (one call per node, all
        concurrently), retrying on the new primary after a fail-over. ``make_args(sids)``
        gives the positional arguments for a node; ``on_reply(addr, reply)`` sees every
        node's answer. Returns {sid: per-shard result}."""
        pending = set(sids)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + float(config.get("ps.failover-timeout"))
        timeout = float(config.get("ps.call-timeout", call_timeout))
        last_exc: BaseException | None = None
        while pending:
            groups = await self._primaries(sched, sorted(pending), deadline)
            addrs = list(groups)
            res = await asyncio.gather(
                *(
                    self._guarded(
                        sched,
                        a,
                        call_actor(
                            rpc, a, self._nodes.get(a, ""), method, *make_args(groups[a]), **kwargs
                        ),
                        timeout,
                    )
                    for a in addrs
                ),
                return_exceptions=True,
            )
            retry = False
            for a, r in zip(addrs, res):
                # the node's answer, not a lost node: asking again (or elsewhere) cannot help
                if isinstance(r, (UpdateRejected, ConfigError, StorageError, ShardUnavailable)):
                    raise r
                if isinstance(r, BaseException):
                    last_exc = r
                    retry = True
                    logger.debug(
                        "server %s: %s on %s failed (%s); refreshing the routing",
                        self.server_id,
                        method,
                        a,
                        r,
                    )
                    continue
                if on_reply is not None:
                    on_reply(a, r)
                for sid, val in r["per_shard"].items():
                    results[int(sid)] = val
                    pending.discard(int(sid))
                if r["moved"]:
                    retry = True
            if pending:
                if time.monotonic() > deadline:
                    raise ShardUnavailable(
                        f"server {self.server_id}: {method} could not reach the primary of shard "
                        f"{min(pending)} ({last_exc})",
                        "check the PS workers",
                        shard=min(pending),
                    ) from last_exc
                gen = self._generation
                await self._refresh(sched)
                if retry and self._generation == gen:
                    await asyncio.sleep(0.05)  # the controller has not seen the change yet
        return results

    async def _guarded(self, sched: Any, addr: str, coro: Any, timeout: float) -> Any:
        """Await a call to the node on ``addr``, giving up early when the controller drops
        ``addr`` (a dead or frozen worker: waiting for it would only time out)."""
        task = asyncio.ensure_future(coro)
        t0 = time.monotonic()
        wait = 0.1
        while True:
            done, _ = await asyncio.wait({task}, timeout=wait)
            wait = min(wait * 2, 0.5)
            if done:
                return task.result()
            if time.monotonic() - t0 > timeout:
                task.cancel()
                raise TimeoutError(f"no answer from the PS node on {addr} in {timeout}s")
            try:
                await self._refresh(sched)
            except Exception:  # pragma: no cover - the scheduler is busy; keep waiting
                continue
            if addr not in self._nodes:
                task.cancel()
                raise OSError(f"the PS worker {addr} was dropped by the controller")

    # -- reading and loading ---------------------------------------------------------------------

    async def _versions(self, rpc: Any, sched: Any) -> dict[int, int]:
        return await self._each_primary(
            rpc, sched, range(len(self.shards)), "pull_versions", lambda s: (s,)
        )

    async def _stats(self, rpc: Any, sched: Any) -> tuple[dict, dict]:
        routing = await sched.adam_ps_routing(server_id=self.server_id)
        self._set_routing(routing)
        addrs = list(self._nodes)
        timeout = float(config.get("ps.call-timeout"))
        res = await asyncio.gather(
            *(call_actor(rpc, a, self._nodes[a], "stats", timeout=timeout) for a in addrs),
            return_exceptions=True,
        )
        nodes = {
            a: (r if not isinstance(r, BaseException) else repr(r)) for a, r in zip(addrs, res)
        }
        return nodes, routing

    async def _load(
        self,
        rpc: Any,
        sched: Any,
        values: np.ndarray,
        versions: dict[int, int],
        marks: dict[int, Any],
    ) -> None:
        """Send initial values (and the data positions they hold) to every holder of every
        shard."""
        per_node: dict[str, list[int]] = {}
        for s, holders in enumerate(self._routing):
            for a in holders:
                per_node.setdefault(a, []).append(s)
        timeout = float(config.get("ps.call-timeout"))
        await asyncio.gather(
            *(
                call_actor(
                    rpc,
                    a,
                    self._nodes[a],
                    "load",
                    {s: values[self.shards[s][0] : self.shards[s][1]] for s in sids},
                    {s: versions[s] for s in sids},
                    {s: list(marks.get(s, ())) for s in sids},
                    timeout=timeout,
                )
                for a, sids in per_node.items()
            )
        )
