"""ParameterServer: the client of the global parameter server (paper section 3.3).

A :class:`ParameterServer` is a small, picklable handle: the server id, the shard ranges and a
cached copy of the routing. The routing itself lives only in the scheduler plugin
(:mod:`adam_dask.ps.placement`); the handle refreshes its copy from there whenever a node does
not answer or reports that a shard moved, and retries. It works from a client (calls go
straight to the PS workers when the client has ``direct_to_workers``, else through the
scheduler) and from inside Dask tasks on any worker (peer-to-peer).

>>> server = ParameterServer.create(client, size=n, checkpoint="file:///srv/ckpt")  # doctest: +SKIP
>>> server.push(delta); server.flush(epoch=1)                                        # doctest: +SKIP
>>> ParameterServer.restore(client, "file:///srv/ckpt").pull()                       # doctest: +SKIP

Delivery: a push is split per shard and sent to the primaries concurrently; a push carries a
random id, so one retried on a new primary after a fail-over is applied once. ``ack`` says when
``push`` returns and what a lost primary may take with it:

* ``"replay"`` (the default): once the primary applied it; the handle keeps the push until the
  primary reports every copy holds it, and sends it again to the new primary after a fail-over
  (:mod:`adam_dask.ps._replay`). No acknowledged update is lost while one copy or the pusher
  survives, at the cost of a copy of each push kept for about a ``forward-interval``.
* ``"all"``: once every copy holds it; nothing acknowledged is lost while one copy survives,
  but every push waits for a forward.
* ``"primary"``: once the primary applied it, as in the paper; the updates of the last
  ``forward-interval`` are lost when that primary dies before forwarding.

Epochs: ``flush(epoch=...)`` stores the epoch number (and ``meta=``) in the manifest;
``checkpoint_meta(epoch=..., meta=...)`` does it without waiting for the flush.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import config
from ..errors import ConfigError, ShardUnavailable, UpdateRejected
from ..model.layout import ParameterLayout, shard_ranges
from ._replay import HeldPush, ReplayLog
from .checkpoint import init_checkpoint, read_checkpoint, write_manifest
from .node import call_actor
from .placement import PLUGIN_NAME, ReplicaPlacement
from .state import OuterPart, first_nonfinite, outer_part

logger = logging.getLogger(__name__)

_ACKS = ("replay", "all", "primary")
_settlers: set[asyncio.Task] = set()  # background settle tasks, kept alive until they finish


class _Retry(Exception):
    """A node could not take a call for routing reasons; refresh and retry."""


class ParameterServer:
    """A handle on a parameter server; make one with :meth:`create`, :meth:`restore` or
    :meth:`attach`."""

    def __init__(
        self,
        server_id: str,
        size: int,
        shards: list[tuple[int, int]],
        *,
        shard_bytes: int,
        replicas: int,
        ack: str,
        checkpoint: str | None,
        storage_options: dict | None,
        layout: ParameterLayout | None,
        meta: dict | None,
        client: Any = None,
    ):
        self.server_id = server_id
        self.size = int(size)
        self.shards = [(int(a), int(b)) for a, b in shards]
        self.shard_bytes = int(shard_bytes)
        self.replicas = int(replicas)
        self.ack = ack
        self.checkpoint = checkpoint
        self.storage_options = storage_options
        self.layout = layout
        self.meta = meta or {}
        self._client = client
        self._routing: list[list[str]] = []
        self._nodes: dict[str, str] = {}
        self._pending: set[int] = set()
        self._lost: set[int] = set()
        self._generation = -1
        self._rng = random.Random()
        self._closed = False
        self._last_stats: tuple[float, int] | None = None
        self._log = ReplayLog()
        self._settler: asyncio.Task | None = None

    def __repr__(self) -> str:
        return (
            f"ParameterServer({self.server_id!r}, {self.size} floats, {len(self.shards)} "
            f"shards x {self.replicas}, ack={self.ack!r})"
        )

    # -- pickling: a copy inside a task binds to that worker -------------------------------------

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_client"] = None
        d["_rng"] = None
        d["_last_stats"] = None
        d["_log"] = None
        d["_settler"] = None
        d["layout"] = self.layout.to_dict() if self.layout is not None else None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._rng = random.Random()
        self._log = ReplayLog()
        if isinstance(self.layout, dict):
            self.layout = ParameterLayout.from_dict(self.layout)

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        client: Any,
        size: int | None = None,
        *,
        layout: ParameterLayout | None = None,
        shard_bytes: int | None = None,
        replicas: int | None = None,
        checkpoint: str | None = None,
        storage_options: dict | None = None,
        init: np.ndarray | None = None,
        meta: dict | None = None,
        ack: str | None = None,
        name: str | None = None,
        epoch: int | None = None,
        _versions: list[int] | None = None,
        _init_checkpoint: bool = True,
    ) -> ParameterServer:
        """Create a parameter server of ``size`` float32 values (or ``layout.size``).

        Parameters
        ----------
        client : distributed.Client
            A client of a cluster with PS workers (resource ``PS``).
        size : int, optional
            Number of float32 parameters; taken from ``layout`` when omitted.
        layout : ParameterLayout, optional
            Names and shapes of the tensors in the flat buffer (stored in the manifest).
        shard_bytes, replicas, ack : optional
            Default to ``adam.ps.shard-bytes``, ``adam.ps.replicas``, ``adam.ps.ack``.
        checkpoint : str, optional
            URL of the checkpoint Zarr (``file://``, ``s3://``, any fsspec URL); None: no
            write-back.
        storage_options : dict, optional
            fsspec options for ``checkpoint``.
        init : array, optional
            Initial flat float32 values (default zeros).
        meta : dict, optional
            JSON-safe data stored in the manifest (model spec...), ``server.meta`` after restore.
        name : str, optional
            The server id (a random one by default); :meth:`attach` finds the server by it.
        epoch : int, optional
            Epoch number written to the initial manifest.
        """
        if layout is not None:
            if size is not None and int(size) != layout.size:
                raise ConfigError(
                    f"size={size} does not match the layout's {layout.size} floats",
                    "give one of size= or layout=",
                )
            size = layout.size
        if size is None:
            raise ConfigError("a parameter server needs size= or layout=")
        size = int(size)
        shard_bytes = int(config.get("ps.shard-bytes", shard_bytes))
        replicas = int(config.get("ps.replicas", replicas))
        ack = config.get("ps.ack", ack)
        if ack not in _ACKS:
            raise ConfigError(
                f"ack={ack!r} is not one of {_ACKS}", "use ack='replay', 'all' or 'primary'"
            )
        if replicas < 1:
            raise ConfigError(f"replicas={replicas}", "keep at least one copy of every shard")
        shards = shard_ranges(size, shard_bytes)
        if init is not None:
            init = np.ascontiguousarray(init, dtype=np.float32).reshape(-1)
            if init.shape[0] != size:
                raise ConfigError(f"init has {init.shape[0]} values, the server {size}")
            bad = first_nonfinite(init)
            if bad >= 0:
                raise UpdateRejected(
                    f"init holds a non-finite value at index {bad}", shard=_shard_of(shards, bad)
                )
        if checkpoint is not None:
            checkpoint = str(checkpoint)
        server_id = name or uuid.uuid4().hex[:12]
        node_config = {
            "forward_interval": float(config.get("ps.forward-interval")),
            "writeback_interval": float(config.get("ps.writeback-interval")),
            "retry_base": float(config.get("ps.retry-base")),
            "retry_max": float(config.get("ps.retry-max")),
            "call_timeout": float(config.get("ps.call-timeout")),
            "dedup_window": int(config.get("ps.dedup-window")),
            "ack": ack,
            "checkpoint": checkpoint,
            "storage_options": storage_options,
            "size": size,
            "shard_bytes": shard_bytes,
        }
        if checkpoint is not None and _init_checkpoint:
            init_checkpoint(
                checkpoint,
                storage_options,
                size=size,
                shard_bytes=shard_bytes,
                shards=shards,
                values=init,
                versions=_versions,
                epoch=epoch,
                meta=meta,
                layout=layout.to_dict() if layout is not None else None,
                server_id=server_id,
            )
        client.register_plugin(ReplicaPlacement(), name=PLUGIN_NAME)
        info = {
            "size": size,
            "shards": [list(s) for s in shards],
            "shard_bytes": shard_bytes,
            "replicas": replicas,
            "ack": ack,
            "checkpoint": checkpoint,
            "storage_options": storage_options,
            "meta": meta or {},
            "layout": layout.to_dict() if layout is not None else None,
        }
        routing = client.sync(
            client.scheduler.adam_ps_create,
            server_id=server_id,
            shards=[list(s) for s in shards],
            replicas=replicas,
            node_config=node_config,
            info=info,
        )
        server = cls(
            server_id,
            size,
            shards,
            shard_bytes=shard_bytes,
            replicas=replicas,
            ack=ack,
            checkpoint=checkpoint,
            storage_options=storage_options,
            layout=layout,
            meta=meta,
            client=client,
        )
        server._set_routing(routing)
        if init is not None or _versions is not None:
            values = init if init is not None else np.zeros(size, dtype=np.float32)
            versions = {i: int(v) for i, v in enumerate(_versions or [0] * len(shards))}
            server._run(server._load, values, versions)
        logger.info("created %r", server)
        return server

    @classmethod
    def restore(
        cls,
        client: Any,
        url: str,
        *,
        storage_options: dict | None = None,
        checkpoint: str | None = None,
        **kwargs: Any,
    ) -> ParameterServer:
        """A new server holding the last complete checkpoint at ``url`` (values, versions,
        layout, ``meta``; ``server.epoch`` is the manifest's epoch). It keeps writing back to
        ``checkpoint`` (default: ``url`` itself)."""
        manifest, values = read_checkpoint(url, storage_options)
        layout = ParameterLayout.from_dict(manifest["layout"]) if manifest.get("layout") else None
        target = checkpoint if checkpoint is not None else url
        same = str(target) == str(url)
        kwargs.setdefault("shard_bytes", int(manifest["shard_bytes"]))
        server = cls.create(
            client,
            size=int(manifest["size"]),
            layout=layout,
            checkpoint=target,
            storage_options=storage_options,
            init=values,
            meta=manifest.get("meta") or {},
            epoch=manifest.get("epoch"),
            _versions=[int(v) for v in manifest["versions"]]
            if kwargs["shard_bytes"] == int(manifest["shard_bytes"])
            else None,
            _init_checkpoint=not same,
            **kwargs,
        )
        server.epoch = manifest.get("epoch")
        logger.info("restored %r from %s (epoch %s)", server, url, server.epoch)
        return server

    @classmethod
    def attach(cls, client: Any, name: str) -> ParameterServer:
        """A handle on the running server ``name`` (e.g. after the creating client restarted;
        the nodes live as long as the scheduler, held by the placement plugin)."""
        routing = client.sync(client.scheduler.adam_ps_routing, server_id=name)
        info = routing["info"]
        layout = ParameterLayout.from_dict(info["layout"]) if info.get("layout") else None
        server = cls(
            name,
            info["size"],
            [tuple(s) for s in info["shards"]],
            shard_bytes=info["shard_bytes"],
            replicas=info["replicas"],
            ack=info["ack"],
            checkpoint=info["checkpoint"],
            storage_options=info["storage_options"],
            layout=layout,
            meta=info["meta"],
            client=client,
        )
        server._set_routing(routing)
        return server

    epoch: Any = None

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
        self._nodes = dict(r["nodes"])
        self._pending = set(r["pending"])
        self._lost = set(r["lost"])
        self._generation = r["generation"]
        self._healthy = r["healthy"]
        self._heal_times = r.get("heal_times", [])

    async def _refresh(self, sched: Any) -> None:
        self._set_routing(await sched.adam_ps_routing(server_id=self.server_id))

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
                    f"every copy of shard {lost[0]} of server {self.server_id} is lost",
                    "restore from the checkpoint",
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
        make_args: Any,
        call_timeout: float | None = None,
        on_reply: Any = None,
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
                    await asyncio.sleep(0.05)  # the controller has not seen the loss yet
        return results

    async def _guarded(self, sched: Any, addr: str, coro: Any, timeout: float) -> Any:
        """Await a call to the node on ``addr``, giving up early when the controller drops
        ``addr`` (a dead worker: connecting to it would only time out)."""
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
                raise OSError(f"the PS worker {addr} was lost")

    # -- public API ------------------------------------------------------------------------------

    def placement(self) -> dict[int, list[str]]:
        """{shard_id: [primary_addr, backup_addr, ...]}, fresh from the scheduler."""
        self._run(lambda rpc, sched: self._refresh(sched))
        return {s: list(h) for s, h in enumerate(self._routing)}

    def routing_info(self) -> dict:
        """The controller's full record: routing, nodes, pending, lost, healthy, generation,
        heal_times (seconds each past fail-over took)."""
        run, _, sched = self._context()
        return run(sched.adam_ps_routing, server_id=self.server_id)

    def push(self, delta: np.ndarray, *, ack: str | None = None) -> None:
        """Add a flat float32 ``delta`` (length ``size``) to the parameters.

        Raises :class:`UpdateRejected` (nothing applied) when it holds NaN/Inf or has the wrong
        length, :class:`ShardUnavailable` when a shard has no copy left or fail-over takes
        longer than ``adam.ps.failover-timeout``.
        """
        delta = np.ascontiguousarray(delta, dtype=np.float32).reshape(-1)
        if delta.shape[0] != self.size:
            raise UpdateRejected(
                f"a delta of {delta.shape[0]} values for a server of {self.size}",
                "push one value per parameter",
            )
        bad = first_nonfinite(delta)
        if bad >= 0:
            sid = _shard_of(self.shards, bad)
            raise UpdateRejected(
                f"non-finite update at flat index {bad} (shard {sid}); nothing was applied",
                "check the gradients for overflow",
                shard=sid,
            )
        self._run(self._push, delta, ack)

    async def _push(self, rpc: Any, sched: Any, delta: np.ndarray, ack: str | None) -> None:
        push_id = self._rng.getrandbits(62)
        ack = ack or self.ack

        def args(sids: list[int]) -> tuple:
            return ({s: delta[self.shards[s][0] : self.shards[s][1]] for s in sids}, push_id, ack)

        def payload(sid: int) -> tuple[Any, int]:
            part = delta[self.shards[sid][0] : self.shards[sid][1]].copy()
            return part, part.nbytes

        await self._send_push(
            rpc, sched, range(len(self.shards)), "push", args, push_id, ack, payload
        )

    def push_outer(
        self,
        offset: int,
        errors: np.ndarray,
        activations: np.ndarray,
        scale: float = 1.0,
        *,
        ack: str | None = None,
    ) -> None:
        """Add ``scale * errors.T @ activations`` to ``flat[offset : offset + out * in]``.

        ``errors`` is (B, out), ``activations`` (B, in), float32; the (out, in) product is
        row-major (a dense layer's weight), computed on the PS nodes that hold it.
        """
        errors = np.ascontiguousarray(errors, dtype=np.float32)
        activations = np.ascontiguousarray(activations, dtype=np.float32)
        if errors.ndim != 2 or activations.ndim != 2 or errors.shape[0] != activations.shape[0]:
            raise UpdateRejected(
                f"push_outer needs errors (B, out) and activations (B, in), got "
                f"{errors.shape} and {activations.shape}"
            )
        out, inp = errors.shape[1], activations.shape[1]
        if offset < 0 or offset + out * inp > self.size:
            raise UpdateRejected(
                f"an ({out}, {inp}) update at offset {offset} does not fit in "
                f"{self.size} parameters"
            )
        for name, a in (("errors", errors), ("activations", activations)):
            if first_nonfinite(a) >= 0:
                raise UpdateRejected(f"non-finite {name} in push_outer; nothing was applied")
        parts: dict[int, OuterPart] = {}
        for s, (a, b) in enumerate(self.shards):
            p = outer_part(offset, out, inp, a, b)
            if p is not None:
                parts[s] = p
        self._run(
            self._push_outer, parts, int(offset), out, inp, errors, activations, float(scale), ack
        )

    async def _push_outer(
        self,
        rpc: Any,
        sched: Any,
        parts: dict,
        offset: int,
        out: int,
        inp: int,
        errors: np.ndarray,
        activations: np.ndarray,
        scale: float,
        ack: str | None,
    ) -> None:
        push_id = self._rng.getrandbits(62)
        ack = ack or self.ack

        def cols(s: int) -> np.ndarray:
            return np.ascontiguousarray(errors[:, parts[s].row0 : parts[s].row1])

        def args(sids: list[int]) -> tuple:
            return ({s: cols(s) for s in sids}, offset, out, inp, activations, scale, push_id, ack)

        def payload(sid: int) -> tuple[Any, int]:
            c = cols(sid).copy()
            return (c, offset, out, inp, activations, scale), c.nbytes + activations.nbytes

        await self._send_push(rpc, sched, parts, "push_outer", args, push_id, ack, payload)

    # -- replay (ack="replay") -------------------------------------------------------------------

    async def _send_push(
        self,
        rpc: Any,
        sched: Any,
        sids: Iterable[int],
        method: str,
        args: Any,
        push_id: int,
        ack: str,
        payload: Any,
    ) -> None:
        """Send one push to the primaries of ``sids``; with ``ack="replay"`` keep each shard's
        part (``payload(sid)`` -> (payload, nbytes)) until every copy holds it."""
        keep = ack == "replay"
        if keep and self._log.nbytes > int(config.get("ps.replay-bytes")):
            await self._settle(rpc, sched, below=int(config.get("ps.replay-bytes")))

        def on_reply(addr: str, reply: dict) -> None:
            if keep:
                for sid, version in reply["per_shard"].items():
                    part, nbytes = payload(int(sid))
                    self._log.add(
                        int(sid), HeldPush(push_id, method, part, addr, int(version), nbytes)
                    )
            self._confirm(addr, reply)

        await self._each_primary(rpc, sched, sids, method, args, on_reply=on_reply)
        if keep:
            await self._replay_moved(rpc, sched)
            if self._log and (self._settler is None or self._settler.done()):
                self._settler = asyncio.ensure_future(self._settle_in_background(rpc, sched))
                _settlers.add(self._settler)
                self._settler.add_done_callback(_settlers.discard)

    def _confirm(self, addr: str, reply: dict) -> None:
        for sid, version in (reply.get("confirmed") or {}).items():
            self._log.confirm(int(sid), addr, int(version))

    def _primary_of(self) -> dict[int, str]:
        return {
            s: h[0]
            for s, h in enumerate(self._routing)
            if h and s not in self._pending and s not in self._lost
        }

    async def _replay_moved(self, rpc: Any, sched: Any) -> int:
        """Send the held pushes of shards whose primary changed to the new primary (same push
        ids: a push the survivors already hold is applied once). Returns how many were sent."""
        sent = 0
        while True:
            moved = self._log.moved(self._primary_of())
            if not moved:
                return sent
            for sid, items in moved.items():
                for h in items:
                    await self._replay_one(rpc, sched, sid, h)
                    sent += 1
            self._log.replayed += sent

    async def _replay_one(self, rpc: Any, sched: Any, sid: int, h: HeldPush) -> None:
        if h.method == "push":
            args: tuple = ({sid: h.payload}, h.push_id, "replay")
        else:
            cols, offset, out, inp, activations, scale = h.payload
            args = ({sid: cols}, offset, out, inp, activations, scale, h.push_id, "replay")

        def on_reply(addr: str, reply: dict) -> None:
            for s, version in reply["per_shard"].items():
                self._log.acknowledged(int(s), h.push_id, addr, int(version))
            self._confirm(addr, reply)

        logger.info(
            "server %s: replaying push %x to the new primary of shard %d",
            self.server_id,
            h.push_id,
            sid,
        )
        await self._each_primary(rpc, sched, [sid], h.method, lambda _: args, on_reply=on_reply)

    async def _settle(self, rpc: Any, sched: Any, below: int = 0) -> None:
        """Until the held pushes take at most ``below`` bytes: replay moved ones, ask the
        primaries what every copy holds. :class:`ShardUnavailable` after the fail-over
        timeout."""
        deadline = time.monotonic() + float(config.get("ps.failover-timeout"))
        interval = float(config.get("ps.forward-interval"))
        while self._log and self._log.nbytes > below:
            await self._replay_moved(rpc, sched)
            sids = self._log.shards()
            if sids:
                await self._each_primary(
                    rpc, sched, sids, "confirmed", lambda s: (s,), on_reply=self._confirm
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
            await self._refresh(sched)

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

    def pull(
        self, shards: Iterable[int] | None = None, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The current flat parameters (from the primaries).

        With ``shards``, only those shards are fetched and written into ``out`` (a flat float32
        buffer, zeros if omitted); the rest of ``out`` is left as it is.
        """
        if out is None:
            out = np.zeros(self.size, dtype=np.float32)
        elif out.dtype != np.float32 or out.shape != (self.size,):
            raise ConfigError(f"out must be a flat float32 array of {self.size} values")
        sids = range(len(self.shards)) if shards is None else sorted({int(s) for s in shards})
        for s in sids:
            if not 0 <= s < len(self.shards):
                raise ConfigError(f"no shard {s}: the server has {len(self.shards)}")
        self._run(self._pull, list(sids), out)
        return out

    async def _pull(self, rpc: Any, sched: Any, sids: list[int], out: np.ndarray) -> None:
        if self._log:
            await self._replay_moved(rpc, sched)
        got = await self._each_primary(rpc, sched, sids, "pull", lambda s: (s,))
        for sid, values in got.items():
            a, b = self.shards[sid]
            out[a:b] = values

    def versions(self) -> dict[int, int]:
        """{shard: version} at the primaries."""
        return self._run(self._versions)

    async def _versions(self, rpc: Any, sched: Any) -> dict[int, int]:
        return await self._each_primary(
            rpc, sched, range(len(self.shards)), "pull_versions", lambda s: (s,)
        )

    def flush(
        self, epoch: Any = None, *, meta: dict | None = None, timeout: float | None = None
    ) -> dict[int, int]:
        """Block until every replica and the checkpoint hold every push acknowledged so far;
        then write the manifest (with ``epoch`` and ``meta`` when given). Returns
        {shard: version} flushed. Waits for a running fail-over to finish first."""
        timeout = float(config.get("ps.flush-timeout", timeout))
        versions = self._run(self._flush, timeout)
        if self.checkpoint is not None:
            write_manifest(self.checkpoint, self.storage_options, versions, epoch=epoch, meta=meta)
        if epoch is not None:
            self.epoch = epoch
        if meta is not None:
            self.meta = meta
        return versions

    async def _flush(self, rpc: Any, sched: Any, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        wait_heal = time.monotonic() + min(timeout, float(config.get("ps.failover-timeout")))
        while True:
            await self._refresh(sched)
            if self._healthy or time.monotonic() > wait_heal:
                break
            await asyncio.sleep(0.1)
        if not self._healthy:
            logger.warning(
                "server %s: flushing with fewer than %d copies of some shards (a "
                "PS worker is missing)",
                self.server_id,
                self.replicas,
            )
        await self._replay_moved(rpc, sched)
        remaining = max(deadline - time.monotonic(), 1.0)

        def flushed(addr: str, reply: dict) -> None:  # every copy holds the flushed versions
            for sid, version in reply["per_shard"].items():
                self._log.confirm(int(sid), addr, int(version))

        return await self._each_primary(
            rpc,
            sched,
            range(len(self.shards)),
            "flush",
            lambda s: (s,),
            call_timeout=remaining + 5,
            on_reply=flushed,
            limit=remaining,
        )

    def checkpoint_meta(self, epoch: Any = None, meta: dict | None = None) -> None:
        """Store ``epoch`` and/or ``meta`` in the manifest now (no flush)."""
        if self.checkpoint is None:
            raise ConfigError("this server has no checkpoint", "create it with checkpoint=URL")
        write_manifest(self.checkpoint, self.storage_options, {}, epoch=epoch, meta=meta)
        if epoch is not None:
            self.epoch = epoch
        if meta is not None:
            self.meta = meta

    def stats(self) -> dict:
        """Figures from every node: ``pushes_applied`` (shard updates applied by primaries),
        ``update_rate`` (shard updates/s since the previous ``stats()``, or since the nodes
        started), ``max_replication_lag`` (versions a backup is behind its primary),
        ``writeback_lag_versions`` / ``writeback_lag_seconds`` (how far the checkpoint is
        behind), ``writeback_errors``, ``healthy``, ``heal_times``, ``nodes``."""
        nodes, routing = self._run(self._stats)
        now = time.monotonic()
        total = sum(n["pushes"] for n in nodes.values() if isinstance(n, dict))
        ok = [n for n in nodes.values() if isinstance(n, dict)]
        if self._last_stats is None:
            span = max((n["uptime"] for n in ok), default=0.0)
            rate = total / span if span > 0 else 0.0
        else:
            t0, c0 = self._last_stats
            rate = (total - c0) / (now - t0) if now > t0 else 0.0
        self._last_stats = (now, total)
        return {
            "server": self.server_id,
            "shards": len(self.shards),
            "replicas": self.replicas,
            "pushes_applied": total,
            "update_rate": rate,
            "max_replication_lag": max((n["replication_lag"] for n in ok), default=0),
            "writeback_lag_versions": max((n["writeback_lag_versions"] for n in ok), default=0),
            "writeback_lag_seconds": max((n["writeback_lag_seconds"] for n in ok), default=0.0),
            "writeback_errors": sum(n["writeback_errors"] for n in ok),
            "healthy": routing["healthy"],
            "heal_times": routing["heal_times"],
            "generation": routing["generation"],
            "nodes": nodes,
        }

    async def _stats(self, rpc: Any, sched: Any) -> tuple[dict, dict]:
        routing = await sched.adam_ps_routing(server_id=self.server_id)
        self._set_routing(routing)
        addrs = list(self._nodes)
        res = await asyncio.gather(
            *(
                call_actor(
                    rpc, a, self._nodes[a], "stats", timeout=float(config.get("ps.call-timeout"))
                )
                for a in addrs
            ),
            return_exceptions=True,
        )
        return {
            a: (r if not isinstance(r, BaseException) else repr(r)) for a, r in zip(addrs, res)
        }, routing

    def close(self) -> None:
        """Stop the nodes and release their actors (the checkpoint stays)."""
        if self._closed:
            return
        run, _, sched = self._context()
        run(sched.adam_ps_close, server_id=self.server_id)
        self._closed = True
        logger.info("closed %r", self)

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def _load(
        self, rpc: Any, sched: Any, values: np.ndarray, versions: dict[int, int]
    ) -> None:
        """Send initial values to every holder of every shard."""
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
                    timeout=timeout,
                )
                for a, sids in per_node.items()
            )
        )


def _shard_of(shards: list[tuple[int, int]], index: int) -> int:
    per = shards[0][1] - shards[0][0]
    return min(index // per, len(shards) - 1)
