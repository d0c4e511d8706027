"""ParameterServer: the client of the global parameter server (paper section 3.3).

A :class:`ParameterServer` is a small, picklable handle: the server id, the shard ranges and a
:class:`~adam_dask.ps.client.courier.Courier` that carries its requests (a copy of the routing, the
data plane's channels, the replay log). Pushes and pulls go from the calling thread straight
to the PS nodes' data plane; control goes through Dask, from a client (straight to the PS
workers when the client has ``direct_to_workers``, else through the scheduler) or from inside
Dask tasks on any worker (peer-to-peer).

Usage (on a cluster, so not a doctest)::

    server = ParameterServer.create(client, size=n, checkpoint="file:///srv/ckpt")
    server.push(delta); server.flush(epoch=1)
    ParameterServer.restore(client, "file:///srv/ckpt").pull()

Delivery: a push is split per shard and sent to the primaries concurrently, with a random id,
so one retried on a new primary after a fail-over is applied once; ``ack`` says when ``push``
returns and what a lost primary may take with it (:data:`~adam_dask.ps.client.build.ACKS`).

Epochs: ``flush(epoch=...)`` stores the epoch number (and ``meta=``) in the manifest;
``checkpoint_meta(epoch=..., meta=...)`` does it without waiting for the flush.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from ... import config
from ..._secrets import redact_urls
from ...errors import ConfigError, StorageError
from ...model.layout import ParameterLayout
from ..protocol.optimizer import ServerOptimizer
from ..protocol.request import Request, overlapping
from ..protocol.shard import Mark
from .build import attach_server, build_server, resolve_copies, resolve_size, restore_server
from .courier import Courier
from .figures import RETRIED, server_figures, storage_error
from .shaping import checked_delta, out_buffer, outer_request, range_request, shard_ids, span

logger = logging.getLogger(__name__)

__all__ = ["ParameterServer"]


class ParameterServer:
    """A handle on a parameter server; make one with :meth:`create`, :meth:`restore` or
    :meth:`attach`. Its requests go through one :class:`~adam_dask.ps.client.courier.Courier`
    (routing, the data plane, Dask for control, the replay log)."""

    epoch: Any = None

    def __init__(
        self,
        server_id: str,
        size: int,
        shards: list[tuple[int, int]],
        *,
        shard_bytes: int,
        copies: int,
        ack: str,
        checkpoint: str | None,
        storage_options: dict | None,
        layout: ParameterLayout | None,
        meta: dict | None,
        client: Any = None,
        optimizer: ServerOptimizer | None = None,
    ):
        self.server_id = server_id
        self.size = int(size)
        self.shards = [(int(a), int(b)) for a, b in shards]
        self.shard_bytes = int(shard_bytes)
        self.copies = int(copies)
        self.ack = ack
        self.checkpoint = checkpoint
        self.storage_options = storage_options
        self.layout = layout
        self.meta = meta or {}
        self.optimizer = optimizer if optimizer is not None else ServerOptimizer()
        self._rng = random.Random()
        self._last_stats: tuple[float, int] | None = None
        self._bounds = np.array(self.shards, dtype=np.int64).reshape(-1, 2)
        self._courier = Courier(server_id, self.size, self.shards, client, self.optimizer)

    def __repr__(self) -> str:
        return (
            f"ParameterServer({self.server_id!r}, {self.size} floats, {len(self.shards)} "
            f"shards x {self.copies}, ack={self.ack!r}, optimizer={self.optimizer.name!r})"
        )

    # -- pickling: a copy inside a task binds to that worker -------------------------------------

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        # a copy in a task pushes and pulls with a courier of its own, starting from this
        # routing: the storage options stay with the creator, and URLs in meta (the training
        # data's) travel without their credentials
        d["_rng"] = d["_last_stats"] = None
        d["_courier"] = vars(self._courier.routing)
        d["storage_options"] = None
        d["meta"] = redact_urls(self.meta)
        d["layout"] = self.layout.to_dict() if self.layout is not None else None
        return d

    def __setstate__(self, d: dict) -> None:
        routing = d.pop("_courier")
        self.__dict__.update(d)
        self._rng = random.Random()
        self._courier = Courier(self.server_id, self.size, self.shards, None, self.optimizer)
        vars(self._courier.routing).update(routing)
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
        copies: int | None = None,
        replicas: int | None = None,
        checkpoint: str | None = None,
        storage_options: dict | None = None,
        init: np.ndarray | None = None,
        meta: dict | None = None,
        ack: str | None = None,
        name: str | None = None,
        epoch: int | None = None,
        optimizer: Any = None,
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
        shard_bytes, copies, ack : optional
            Default to ``adam.ps.shard-bytes``, ``adam.ps.copies``, ``adam.ps.ack``;
            ``replicas=`` is the older name of ``copies=``.
        checkpoint : str, optional
            URL of the checkpoint Zarr (``file://``, ``s3://``, any fsspec URL); None: no
            write-back (and no rebuilding of a shard whose copies are all lost).
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
        optimizer : str, dict or ServerOptimizer, optional
            What a shard does with a push (:mod:`~adam_dask.ps.protocol.optimizer`): ``"sum"``,
            ``"nesterov"``, either ``+staleness``; default ``adam.ps.optimizer``.
        """
        return build_server(
            cls,
            client,
            size=resolve_size(size, layout),
            layout=layout,
            shard_bytes=shard_bytes,
            copies=resolve_copies(copies, replicas),
            checkpoint=checkpoint,
            storage_options=storage_options,
            init=init,
            meta=meta,
            ack=ack,
            name=name,
            epoch=epoch,
            optimizer=ServerOptimizer.resolve(optimizer),
        )

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
        layout, ``meta``, the server optimizer and its momentum; ``server.epoch`` is the
        manifest's epoch). It keeps writing back to ``checkpoint`` (default: ``url`` itself).
        Other keywords are those of :meth:`create` (``optimizer=`` replaces the checkpoint's)."""
        return restore_server(cls, client, url, storage_options, checkpoint, kwargs)

    @classmethod
    def attach(cls, client: Any, name: str) -> ParameterServer:
        """A handle on the running server ``name`` (e.g. after the creating client restarted;
        the nodes live as long as the scheduler, held by the placement plugin)."""
        return attach_server(cls, client, name)

    # -- public API ------------------------------------------------------------------------------

    def placement(self) -> dict[int, list[str]]:
        """{shard_id: [primary_addr, backup_addr, ...]}, fresh from the scheduler."""
        self._courier.refresh()
        return {s: list(h) for s, h in enumerate(self._courier.routing.table)}

    def routing_info(self) -> dict:
        """The controller's record: ``routing``, ``gens`` (each shard's generation), ``nodes``,
        ``pending`` (shards without a primary right now), ``lost``, ``healthy``, ``target``,
        ``generation``, ``heal_times`` (seconds from each loss to full copies again),
        ``restored`` (shards rebuilt from the checkpoint), ``declared_dead``,
        ``refused_writes``, ``manifest_errors`` (failed writes of the manifest),
        ``manifest_failing`` (those since the last one written: storage is out while > 0),
        ``last_manifest_error``, ``info``."""
        return self._courier.control.routing()

    def push(self, delta: np.ndarray, *, ack: str | None = None, mark: Mark | None = None) -> None:
        """Add a flat float32 ``delta`` (length ``size``) to the parameters.

        ``mark`` (:class:`~adam_dask.ps.protocol.shard.Mark`): what the push covers of the pusher's
        data. Each shard records it atomically with the values (replicated, written back) and
        skips a push whose ``(seq, part)`` is at or below the one it recorded for the pusher;
        :meth:`marks` reads them.

        A :meth:`buffer` is handed over as it is: shared with nodes on this machine without
        copying the values, and kept by reference until the push is durable (write to it no
        more; :meth:`release` it). Any other array is copied once.

        Raises :class:`UpdateRejected` (nothing applied) when it holds NaN/Inf or has the wrong
        length, :class:`ShardUnavailable` when a shard has no copy left or fail-over takes
        longer than ``adam.ps.failover-timeout``.
        """
        self._push_now(delta, ack, mark, None)

    def push_pull(
        self,
        delta: np.ndarray,
        out: np.ndarray | None = None,
        *,
        ack: str | None = None,
        mark: Mark | None = None,
    ) -> np.ndarray:
        """:meth:`push`, then :meth:`pull` into ``out`` (a flat float32 buffer, a new one if
        omitted) and return it: what a replica does every *k* images, in one round trip per
        primary on the data plane (the values read after the push was applied)."""
        out = out_buffer(out, self.size)
        self._push_now(delta, ack, mark, out)
        return out

    def _push_now(
        self, delta: np.ndarray, ack: str | None, mark: Mark | None, pull: np.ndarray | None
    ) -> None:
        """Check ``delta`` once and send it to the primaries (reading the shards back into
        ``pull`` on the way)."""
        channels = self._courier.channels_or_none()  # a copy goes into its pool (the plane on)
        pool = channels.pool if channels is not None else None
        delta, nonzero, seg = checked_delta(delta, self.size, self.shards, self._bounds, pool)
        push_id, sids = self._rng.getrandbits(62), tuple(range(len(self.shards)))
        req = Request("push", sids, push_id, ack or self.ack, mark, values=delta, nonzero=nonzero)
        if seg is not None:  # released when delivered (held parts keep a lease on it)
            req.args["own_segment"] = seg
        if pull is not None:
            req.pull, req.args["out"] = True, pull
        self._courier.send_push(req)

    def push_outer(
        self,
        offset: int,
        errors: np.ndarray,
        activations: np.ndarray,
        scale: float = 1.0,
        *,
        ack: str | None = None,
        mark: Mark | None = None,
    ) -> None:
        """Add ``scale * errors.T @ activations`` to ``flat[offset : offset + out * in]``.
        ``mark`` as for :meth:`push`.

        ``errors`` is (B, out), ``activations`` (B, in), float32; the (out, in) product is
        row-major (a dense layer's weight), computed on the PS nodes that hold it.
        """
        push_id = self._rng.getrandbits(62)
        shards, ack = self.shards, ack or self.ack
        req = outer_request(
            offset, errors, activations, scale, self.size, shards, push_id, ack, mark
        )
        self._courier.send_push(req)

    def push_range(
        self,
        values: np.ndarray,
        start: int,
        *,
        ack: str | None = None,
        mark: Mark | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Add ``values`` (flat float32) to the parameters ``[start, start + len(values))``,
        sending only to the shards that overlap that range (a partition of a replica holds one
        span; a shard straddling its edge gets zeros outside it). ``mark`` as for ``push``
        (its ``targets`` become those shards). With ``out`` (float32 like ``values``) the span
        is read back into it after the push, in the same round trip per primary on the data
        plane (a replica's stage exchange), and
        returned. Raises :class:`UpdateRejected` (nothing applied) on NaN/Inf."""
        push_id = self._rng.getrandbits(62)
        req = range_request(values, start, self.size, self.shards, push_id, ack or self.ack, mark)
        if out is not None:
            out = out_buffer(out, req.values.shape[0])
            req.pull = True
            req.args.update(out=out, out_base=req.base)
        self._courier.send_push(req)
        return out

    def pull_range(self, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """The current parameters ``[start, stop)`` (from the primaries of the shards that
        overlap it), written into ``out`` (float32 (stop - start,), a new array if omitted)."""
        start, stop = span(start, int(stop) - int(start), self.size)
        out = out_buffer(out, stop - start)
        self._courier.pull(tuple(overlapping(self.shards, start, stop)), out, start)
        return out

    def pull(
        self, shards: Iterable[int] | None = None, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The current flat parameters (from the primaries).

        With ``shards``, only those shards are fetched and written into ``out`` (a flat float32
        buffer, zeros if omitted); the rest of ``out`` is left as it is.
        """
        out = out_buffer(out, self.size)
        self._courier.pull(shard_ids(shards, len(self.shards)), out)
        return out

    def marks(self, epoch: int) -> dict[int, dict[int, tuple[Mark, ...]]]:
        """{shard: {replica: the marks of its pushes of ``epoch`` the primary applied}}: the
        data positions the parameters hold, per shard."""
        req = Request("marks", tuple(range(len(self.shards))), args={"epoch": int(epoch)})
        return self._courier.deliver(req).results

    def versions(self) -> dict[int, int]:
        """{shard: version} at the primaries."""
        return self._courier.deliver(Request("versions", tuple(range(len(self.shards))))).results

    def settle(self, timeout: float | None = None, *, checkpoint: bool = True) -> None:
        """Block until every push made through this handle is held by every copy of its shard
        and, with ``checkpoint`` (and a checkpoint), by the checkpoint too. With
        ``ack="replay"`` a pusher that ends calls this so that nothing it was told is applied
        depends on it any more: a replica task does at its end with ``checkpoint=False`` (the
        copies hold what it pushed before its result counts; the checkpoint catches up on its
        own, however long storage is away)."""
        timeout = float(config.get("ps.failover-timeout", timeout))
        self._courier.settle(copies_only=not checkpoint, limit=timeout)

    def held(self) -> dict:
        """``{"pushes", "bytes", "unreplicated"}``: what this handle holds for replay now
        (``ack="replay"``; ``unreplicated``: pushes some copy still lacks)."""
        return {
            "pushes": len(self._courier.log),
            "bytes": int(self._courier.log.nbytes),
            "unreplicated": int(self._courier.log.unreplicated),
        }

    def flush(
        self,
        epoch: Any = None,
        *,
        meta: dict | None = None,
        timeout: float | None = None,
        copies_only: bool = False,
    ) -> dict[int, int]:
        """Block until every copy and the checkpoint hold every push acknowledged so far; then
        store ``epoch`` and ``meta`` (when given) in the manifest. Returns {shard: version}
        flushed. Waits for a running fail-over to finish first.

        ``copies_only=True`` waits for the copies alone, so storage never holds the caller up
        (an epoch's end); the write-back goes on, and with ``ack="replay"`` the pushes stay
        held until the checkpoint has them. Raises :class:`StorageError` naming the checkpoint
        when storage is what did not hold the pushes within ``timeout`` (config
        ``adam.ps.flush-timeout``), :class:`ShardUnavailable` when the copies did not."""
        timeout = float(config.get("ps.flush-timeout", timeout))
        durable = self.checkpoint is not None and not copies_only
        if copies_only and (epoch is not None or meta is not None):
            raise ConfigError(
                "flush(copies_only=True) stores no epoch or meta", "flush with the checkpoint"
            )
        t0 = time.monotonic()
        try:
            versions = self._courier.flush(timeout, durable, self.copies)
            if durable:
                left = max(timeout - (time.monotonic() - t0), 1.0)
                try:
                    self._courier.control.commit(epoch, meta, left)
                except TimeoutError:
                    raise StorageError(
                        f"the manifest was not written in {timeout:g}s", RETRIED
                    ) from None
        except StorageError as exc:
            raise self.storage_error(exc) from exc
        if epoch is not None:
            self.epoch = epoch
        if meta is not None:
            self.meta = meta
        return versions

    def storage_error(self, exc: BaseException) -> StorageError:
        """One line that names the checkpoint's storage (its URL without secrets) as the cause
        of ``exc``."""
        return storage_error(self.checkpoint, exc)

    def checkpoint_meta(self, epoch: Any = None, meta: dict | None = None) -> None:
        """Store ``epoch`` and/or ``meta`` in the manifest now (no flush)."""
        if self.checkpoint is None:
            raise ConfigError("this server has no checkpoint", "create it with checkpoint=URL")
        self._courier.control.commit(epoch, meta)
        if epoch is not None:
            self.epoch = epoch
        if meta is not None:
            self.meta = meta

    def stats(self) -> dict:
        """Figures from the controller, every node and this handle: what was applied, how far
        the copies and the checkpoint lag, fail-overs and restores, what this handle holds and
        sent by transport, and each node's own (:func:`~.figures.server_figures` names every
        key)."""
        nodes, routing = self._stats()
        now = time.monotonic()
        figures = server_figures(self, self._courier, nodes, routing, now, self._last_stats)
        self._last_stats = (now, figures["pushes_applied"])
        return figures

    def story(self, sid: int | None = None) -> dict:
        """Why shard ``sid`` (every shard: ``None``) is where it is: ``{"controller": [...],
        "nodes": {addr: [...]}}``, each the events of note that machine handled, oldest first
        (``stimulus``, ``event``, ``shards``, ``actions``): the controller's fail-overs,
        fences, promotions and restores, each node's commands and step-downs. Bounded: the
        newest 256 events of each."""
        courier = self._courier
        courier.refresh()
        return {"controller": courier.control.story(sid), "nodes": courier.ask_nodes("story", sid)}

    def _stats(self) -> tuple[dict, dict]:
        courier = self._courier
        routing = courier.control.routing()
        courier.routing.set(routing)
        return courier.ask_nodes("stats"), routing

    def buffer(self) -> np.ndarray:
        """A float32 array of the server's size from the handle's pool, for a delta to push
        with :meth:`push` by reference (or weights to pull into); give it back with
        :meth:`release` (the server keeps it as long as it needs it, then reuses it)."""
        channels = self._courier.channels_or_none()
        if channels is None:
            return np.empty(self.size, np.float32)
        return channels.pool.take().array

    def release(self, array: np.ndarray) -> None:
        """The caller is done with a :meth:`buffer` (it is not written again by the caller)."""
        channels = self._courier.channels
        seg = None if channels is None else channels.pool.of(array)
        if seg is not None:
            seg.release()

    def close(self) -> None:
        """Stop the nodes and release their actors (the checkpoint stays)."""
        courier = self._courier
        if courier.control.closed:
            return
        courier.control.run(lambda rpc, sched: sched.adam_ps_close(server_id=self.server_id))
        courier.close()
        logger.info("closed %r", self)

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
