"""The PS nodes' lives on the cluster, as the controller's plugin needs them: a node actor made
on a PS worker and started (through a client of the scheduler's own), nodes released when their
server closes, and a silent worker taken out of the cluster (its nanny, when it answers,
starting a fresh one)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from ... import config
from .node import PSNode
from .rpc import call_actor

logger = logging.getLogger(__name__)

__all__ = ["NodeKeeper"]


def _controller_security(scheduler: Any) -> Any:
    """Security for the controller's client inside the scheduler. A TLS scheduler (dask-gateway,
    Kubernetes) is configured with scheduler credentials only; the controller presents those
    same credentials as a client."""
    from distributed.security import Security

    sec = scheduler.security
    if not scheduler.address.startswith("tls://") or sec.tls_client_cert:
        return sec
    return Security(
        tls_ca_file=sec.tls_ca_file,
        tls_client_cert=sec.tls_scheduler_cert,
        tls_client_key=sec.tls_scheduler_key,
        require_encryption=sec.require_encryption,
    )


class NodeKeeper:
    """Node actors and PS workers of one scheduler (see the module doc)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.client_: Any = None
        self.lock = asyncio.Lock()
        self.counter = itertools.count()
        self.actors: dict[str, dict[str, Any]] = {}  # server -> addr -> actor future

    @property
    def timeout(self) -> float:
        return float(config.get("ps.call-timeout"))

    async def close(self) -> None:
        if self.client_ is not None:
            client, self.client_ = self.client_, None
            try:
                await client.close(timeout=2)
            except Exception:  # pragma: no cover - shutting down
                pass

    async def get_client(self) -> Any:
        assert self.lock is not None
        async with self.lock:
            if self.client_ is None:
                from distributed import Client

                self.client_ = await Client(
                    self.scheduler.address,
                    asynchronous=True,
                    set_as_default=False,
                    direct_to_workers=True,
                    security=_controller_security(self.scheduler),
                    name="adam-ps-controller",
                )
            return self.client_

    async def new_node(self, server_id: str, addr: str, node_config: dict) -> str:
        """A started PSNode of ``server_id`` on ``addr`` (pinned); returns its key."""
        client = await self.get_client()
        key = f"adam-ps-{server_id}-node{next(self.counter)}"
        fut = client.submit(
            PSNode,
            server_id,
            node_config,
            actor=True,
            key=key,
            workers=[addr],
            allow_other_workers=False,
            pure=False,
        )
        # one bound for the whole creation: the actor made, then its kernels loaded
        deadline = time.monotonic() + float(config.get("ps.create-timeout"))
        try:
            await asyncio.wait_for(fut, deadline - time.monotonic())
            left = max(1.0, deadline - time.monotonic())
            await call_actor(self.scheduler.rpc, addr, key, "start", key, timeout=left)
        except BaseException:
            fut.release()
            raise
        self.actors.setdefault(server_id, {})[addr] = fut
        return key

    async def retire(self, addr: str) -> None:
        """A node missed its heartbeats: take its worker out of the cluster. A frozen process
        cannot hand anything over. When its nanny answers (the process hung, the machine did
        not), the nanny SIGKILLs it and starts a fresh worker, which joins under a new address as
        an empty node the controller places copies on again: the cluster keeps its size, as a
        restarted machine would rejoin (``adam.ps.replace-retired``). Otherwise (the whole
        machine is silent, or replacing is off) the worker is told to close, and does so, with
        its nanny, if it ever wakes."""
        ws = self.scheduler.workers.get(addr)
        if ws is None:
            return
        nanny = ws.nanny if config.get("ps.replace-retired") else None
        logger.warning("PS controller: removing the silent worker %s from the cluster", addr)
        try:
            # no "close" for a worker its nanny replaces: woken inside the nanny's grace, the
            # worker would run it and close the nanny with itself (a host lost for good)
            await self.scheduler.remove_worker(
                address=addr,
                stimulus_id=f"adam-ps-heartbeat-missed-{time.time()}",
                close=not nanny,
            )
        except Exception:  # pragma: no cover - the worker may be gone already
            logger.exception("removing %s failed", addr)
        if not nanny:
            return
        try:
            # the nanny SIGKILLs it after 0.4 s (a short grace: woken in it, the worker would
            # find itself unknown to the scheduler and close the nanny with itself) and, seeing
            # its worker die while it runs, starts a new one
            await asyncio.wait_for(
                self.scheduler.rpc(nanny).kill(timeout=0.5, reason="adam-ps-heartbeat-missed"),
                self.timeout,
            )
        except Exception as exc:
            logger.warning(
                "PS controller: the nanny %s of the silent worker %s did not replace it (%s: "
                "%s); the worker, unknown to the scheduler, shuts down when it wakes",
                nanny,
                addr,
                type(exc).__name__,
                exc,
            )
        else:
            logger.warning(
                "PS controller: the nanny %s killed the silent worker %s and starts a new one",
                nanny,
                addr,
            )

    async def release(self, server_id: str, nodes: dict[str, str]) -> None:
        await asyncio.gather(
            *(
                call_actor(self.scheduler.rpc, a, k, "close", timeout=self.timeout)
                for a, k in nodes.items()
            ),
            return_exceptions=True,
        )
        for fut in self.actors.pop(server_id, {}).values():
            fut.release()
