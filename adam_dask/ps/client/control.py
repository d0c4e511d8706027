"""The client's Dask side: the controller in the scheduler (routing, commit, close) and actor
calls to the nodes, from a client (straight to the workers with ``direct_to_workers``, else
through the scheduler) or from inside a Dask task (peer-to-peer, on the worker's loop).

Control travels here: the routing, flushes, marks, versions, statistics, the data plane's
endpoints, a new server's first values. Pushes and pulls travel on the data plane
(:mod:`adam_dask.ps.plane.channels`); this module carries them only where the plane can not go
(``adam.ps.data-plane: dask``, a firewall between pusher and node), as :class:`DaskCalls`, with the
same request and the same answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import numpy as np

from ...errors import ShardUnavailable
from ..protocol.node_requests import OuterRequest, PushRequest, node_request
from ..protocol.replies import NodeReply, PullReply, reply_from_wire
from ..protocol.request import Request, part_of, write_pulled
from ..runtime.rpc import call_actor

logger = logging.getLogger(__name__)

__all__ = ["Control", "DaskCalls"]


class Control:
    """Where a handle's coroutines run and how it reaches workers and the scheduler."""

    def __init__(self, server_id: str, client: Any = None):
        self.server_id = server_id
        self.client = client
        self.closed = False

    def context(self) -> tuple[Any, Any, Any, Any]:
        """(run, rpc, scheduler, asyncio loop): a worker's own when called inside a task, else
        the client's."""
        from distributed import get_worker
        from distributed.actor import ProxyRPC
        from distributed.utils import sync

        try:
            worker = get_worker()
        except ValueError:
            worker = None
        if worker is not None:
            return (
                (lambda f, *a, **k: sync(worker.loop, f, *a, **k)),
                worker.rpc,
                worker.scheduler,
                worker.loop.asyncio_loop,  # type: ignore[attr-defined]
            )
        client = self.client
        if client is None:
            from distributed import default_client

            client = self.client = default_client()
        if client.direct_to_workers:
            rpc = client.rpc
        else:

            def rpc(addr: str) -> ProxyRPC:
                return ProxyRPC(client.scheduler, addr)

        return client.sync, rpc, client.scheduler, client.loop.asyncio_loop

    def tls_context(self) -> Any:
        """The SSL context this process presents on a TLS cluster (:mod:`adam_dask.net.tls`)."""
        from ...net.tls import connect_context

        return connect_context(self.client)

    def run(self, coro_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``coro_fn(rpc, scheduler, *args)`` on the loop and wait for it."""
        if self.closed:
            raise ShardUnavailable(f"parameter server {self.server_id} is closed")
        run, rpc, sched, _ = self.context()
        return run(coro_fn, rpc, sched, *args, **kwargs)

    def routing(self) -> dict:
        """The controller's record of this server (``adam_ps_routing``)."""
        return self.run(lambda rpc, sched: sched.adam_ps_routing(server_id=self.server_id))

    def commit(self, epoch: Any, meta: dict | None, timeout: float | None = None) -> dict:
        """Store ``epoch`` and ``meta`` in the manifest (``adam_ps_commit``): answered once the
        controller has written a manifest naming them."""
        server_id = self.server_id

        async def commit(rpc: Any, sched: Any) -> dict:
            coro = sched.adam_ps_commit(server_id=server_id, epoch=epoch, meta=meta)
            return await asyncio.wait_for(coro, timeout)

        return self.run(commit)

    def story(self, sid: int | None) -> list[dict]:
        """The controller's story of shard ``sid`` (``adam_ps_story``)."""
        return self.run(lambda rpc, sched: sched.adam_ps_story(server_id=self.server_id, sid=sid))

    def call(self, addr: str, key: str, method: str, *args: Any, timeout: float) -> Any:
        """Call ``method`` of the node ``key`` on ``addr`` and wait for its answer."""

        async def go(rpc: Any, sched: Any) -> Any:
            return await call_actor(rpc, addr, key, method, *args, timeout=timeout)

        return self.run(go)

    def start(
        self, addr: str, key: str, method: str, *args: Any, timeout: float, **kwargs: Any
    ) -> concurrent.futures.Future:
        """Start the same call without waiting (several nodes are called at once)."""
        if self.closed:
            raise ShardUnavailable(f"parameter server {self.server_id} is closed")
        _, rpc, _, loop = self.context()
        coro = call_actor(rpc, addr, key, method, *args, timeout=timeout, **kwargs)
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def each(self, calls: dict[str, tuple], timeout: float) -> dict[str, Any]:
        """{addr: answer or exception} of ``calls`` {addr: (key, method, *args)}, all at once."""

        async def go(rpc: Any, sched: Any) -> dict:
            addrs = list(calls)
            res = await asyncio.gather(
                *(call_actor(rpc, a, *calls[a], timeout=timeout) for a in addrs),
                return_exceptions=True,
            )
            return dict(zip(addrs, res))

        return self.run(go)


class DaskCalls:
    """A request's part for one node as a Dask actor call: control calls always, pushes and
    pulls where the data plane can not reach the node. Answers as the plane's (the
    :mod:`~adam_dask.ps.protocol.replies`); a pull writes its values into the request's
    ``out``."""

    def __init__(self, control: Control, shards: list[tuple[int, int]]):
        self.control = control
        self.shards = shards

    def start(
        self, addr: str, key: str, req: Request, sids: tuple[int, ...], stamps: dict, timeout: float
    ) -> concurrent.futures.Future:
        c = self.control
        sl = tuple(sids)
        if req.data:  # the node's ``call``: the header the data plane would send, the values
            head = node_request(req, sl, stamps, c.server_id, self.shards)
            payload: Any = None
            if isinstance(head, OuterRequest):
                o = req.outer
                assert o is not None
                cols = {s: np.ascontiguousarray(o.errors[:, slice(*o.cols[s])]) for s in sl}
                payload = (cols, o.activations)
            elif isinstance(head, PushRequest):
                parts = {s: part_of(req, self.shards[s], s) for s in sl}
                payload = {s: v for s, v in parts.items() if v is not None}
            return c.start(addr, key, "call", head.to_wire(), payload, timeout=timeout)
        if req.op == "flush":
            return c.start(addr, key, "flush", list(sl), timeout=timeout, **req.args)
        if req.op == "marks":
            return c.start(addr, key, "marks", list(sl), req.args["epoch"], timeout=timeout)
        if req.op == "versions":
            return c.start(addr, key, "pull_versions", list(sl), timeout=timeout)
        raise ValueError(f"no such request {req.op!r}")  # pragma: no cover

    def finish(self, req: Request, wire: dict) -> NodeReply:
        """The node's answer (the dict it came as), a pull's values written where the request
        wants them."""
        reply = reply_from_wire(req.op, wire)
        if isinstance(reply, PullReply):
            for s, values in reply.per_shard.items():
                assert values is not None
                write_pulled(req, self.shards[s], values)
            reply = PullReply(dict.fromkeys(reply.per_shard), reply.moved, reply.versions)
        return reply
