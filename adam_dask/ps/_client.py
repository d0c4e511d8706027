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

from .. import config
from ..errors import ConfigError, ShardUnavailable, UpdateRejected
from ._replay import HeldPush, ReplayLog
from .node import call_actor

logger = logging.getLogger(__name__)

__all__ = ["Transport"]

_settlers: set[asyncio.Task] = set()  # background settle tasks, kept alive until they finish


class Transport:
    """The call machinery of a parameter-server handle (mixed into ParameterServer)."""

    server_id: str
    shards: list[tuple[int, int]]
    _client: Any
    _closed: bool
    _log: ReplayLog
    _settler: asyncio.Task | None

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
                if isinstance(r, (UpdateRejected, ConfigError)):
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

    # -- pushes and their replay -----------------------------------------------------------------

    async def _send_push(
        self,
        rpc: Any,
        sched: Any,
        sids: Iterable[int],
        method: str,
        args: Callable[[list[int]], tuple],
        push_id: int,
        ack: str,
        payload: Callable[[int], tuple[Any, int]],
    ) -> None:
        """Send one push to the primaries of ``sids``; with ``ack="replay"`` keep each shard's
        part (``payload(sid)`` -> (payload, nbytes)) until every copy holds it."""
        keep = ack == "replay"
        limit = int(config.get("ps.replay-bytes"))
        if keep and self._log.nbytes > limit:
            await self._settle(rpc, sched, below=limit)

        def on_reply(addr: str, reply: dict) -> None:
            if keep:
                for sid, version in reply["per_shard"].items():
                    part, nbytes = payload(int(sid))
                    gen = int(reply["gens"][sid])
                    held = HeldPush(push_id, method, part, addr, gen, int(version), nbytes)
                    self._log.add(int(sid), held)
            self._confirm(addr, reply)

        await self._each_primary(rpc, sched, sids, method, args, on_reply=on_reply)
        if keep:
            await self._replay_moved(rpc, sched)
            if self._log and (self._settler is None or self._settler.done()):
                self._settler = asyncio.ensure_future(self._settle_in_background(rpc, sched))
                _settlers.add(self._settler)
                self._settler.add_done_callback(_settlers.discard)

    def _confirm(self, addr: str, reply: dict, key: str = "confirmed") -> None:
        """Drop the held pushes ``reply`` (``reply[key]``: {sid: version}) says every copy
        holds; ``reply["gens"]`` names the generation of the answering primary."""
        for sid, version in (reply.get(key) or {}).items():
            self._log.confirm(int(sid), addr, int(reply["gens"][sid]), int(version))

    async def _replay_moved(self, rpc: Any, sched: Any) -> int:
        """Send the held pushes of shards whose primary changed to the new primary (same push
        ids: a push the survivors or the checkpoint already hold is applied once). Returns how
        many were sent."""
        sent = 0
        while True:
            moved = self._log.moved(self._primary_of())
            if not moved:
                return sent
            for sid, items in moved.items():
                for h in items:
                    await self._replay_one(rpc, sched, sid, h)
                    sent += 1
                    self._log.replayed += 1

    async def _replay_one(self, rpc: Any, sched: Any, sid: int, h: HeldPush) -> None:
        def args(sids: list[int]) -> tuple:
            stamps = self._stamps([sid])
            if h.method == "push":
                return ({sid: h.payload}, h.push_id, "replay", stamps)
            cols, offset, out, inp, activations, scale = h.payload
            return ({sid: cols}, offset, out, inp, activations, scale, h.push_id, "replay", stamps)

        def on_reply(addr: str, reply: dict) -> None:
            for s, version in reply["per_shard"].items():
                self._log.acknowledged(int(s), h.push_id, addr, int(reply["gens"][s]), int(version))
            self._confirm(addr, reply)

        logger.info(
            "server %s: replaying push %x to the new primary of shard %d",
            self.server_id,
            h.push_id,
            sid,
        )
        await self._each_primary(rpc, sched, [sid], h.method, args, on_reply=on_reply)

    async def _settle(self, rpc: Any, sched: Any, below: int = 0) -> None:
        """Until the held pushes take at most ``below`` bytes: replay moved ones, ask the
        primaries what every copy holds. :class:`ShardUnavailable` after the fail-over
        timeout."""
        deadline = time.monotonic() + float(config.get("ps.failover-timeout"))
        interval = float(config.get("ps.forward-interval"))
        while self._log and self._log.nbytes > below:
            await self._refresh(sched)
            await self._replay_moved(rpc, sched)
            sids = self._log.shards()
            if sids:
                await self._each_primary(
                    rpc,
                    sched,
                    sids,
                    "confirmed",
                    lambda s: (s,),
                    on_reply=lambda a, r: self._confirm(a, r, "per_shard"),
                )
            if not self._log or self._log.nbytes <= below:
                return
            if time.monotonic() > deadline:
                sid = self._log.shards()[0]
                raise ShardUnavailable(
                    f"server {self.server_id}: the copies of shard {sid} did not confirm "
                    f"{len(self._log)} acknowledged push(es) in time",
                    "check the PS workers (adam.ps.failover-timeout)",
                    shard=sid,
                )
            await asyncio.sleep(interval / 2)

    async def _settle_in_background(self, rpc: Any, sched: Any) -> None:
        """Keep settling while pushes are held (so they are replayed after a fail-over even
        when no more pushes come); ends when every held push is confirmed."""
        interval = float(config.get("ps.forward-interval"))
        while self._log and not self._closed:
            await asyncio.sleep(interval)
            try:
                await self._settle(rpc, sched)
            except Exception as exc:
                logger.warning(
                    "server %s: %d held push(es) not confirmed yet (%s); still trying",
                    self.server_id,
                    len(self._log),
                    exc,
                )
