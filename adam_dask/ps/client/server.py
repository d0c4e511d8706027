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

Delivery: a push is split per shard and sent to the primaries concurrently; a push carries a
random id, so one retried on a new primary after a fail-over is applied once. ``ack`` says when
``push`` returns and what a lost primary may take with it:

* ``"replay"`` (the default): once the primary applied it; the handle keeps the push until the
  primary reports every copy holds it, and sends it again to the new primary after a fail-over
  (:mod:`adam_dask.ps.protocol.replay`). No acknowledged update is lost while one copy or the pusher
  survives, at the cost of a copy of each push kept for about a ``forward-interval``.
* ``"all"``: once every copy holds it; nothing acknowledged is lost while one copy survives,
  but every push waits for a forward.
* ``"primary"``: once the primary applied it, as in the paper; the updates of the last
  ``forward-interval`` are lost when that primary dies before forwarding.

A shard whose copies are all lost is rebuilt from its last write-back in the checkpoint while
training goes on; the updates after that write-back are lost (``stats()["restored"]``).

Epochs: ``flush(epoch=...)`` stores the epoch number (and ``meta=``) in the manifest;
``checkpoint_meta(epoch=..., meta=...)`` does it without waiting for the flush.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from ... import config
from ..._secrets import redact_url, redact_urls
from ...errors import ConfigError, StorageError, UpdateRejected
from ...model.layout import ParameterLayout
from ...storage import normalize_url
from ..checkpoint import read_checkpoint, read_marks
from ..kernels import first_nonfinite, scan_delta
from ..protocol.request import Outer, Request, overlapping
from ..protocol.shard import Mark, outer_part
from .build import build_server, resolve_copies, shard_of
from .courier import Courier

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
        self._rng = random.Random()
        self._last_stats: tuple[float, int] | None = None
        self._bounds = np.array(self.shards, dtype=np.int64).reshape(-1, 2)
        self._courier = Courier(server_id, self.size, self.shards, client)

    @property
    def replicas(self) -> int:
        """The copies of each shard (the older name)."""
        return self.copies

    def __repr__(self) -> str:
        return (
            f"ParameterServer({self.server_id!r}, {self.size} floats, {len(self.shards)} "
            f"shards x {self.copies}, ack={self.ack!r})"
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
        self._courier = Courier(self.server_id, self.size, self.shards, None)
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
        return cls._build(
            client,
            size=int(size),
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
        )

    @classmethod
    def _build(cls, client: Any, **settings: Any) -> ParameterServer:
        """A new server from resolved settings (:func:`~adam_dask.ps.client.build.build_server`): the
        one constructor ``create`` and ``restore`` share, with no private keywords."""
        return build_server(cls, client, **settings)

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
        ``checkpoint`` (default: ``url`` itself). Other keywords are those of :meth:`create`."""
        manifest, values = read_checkpoint(url, storage_options)
        layout = ParameterLayout.from_dict(manifest["layout"]) if manifest.get("layout") else None
        target = checkpoint if checkpoint is not None else url
        shard_bytes = int(kwargs.pop("shard_bytes", None) or manifest["shard_bytes"])
        same_shards = shard_bytes == int(manifest["shard_bytes"])
        keep = (
            normalize_url(str(target)) == normalize_url(str(url))
            and same_shards
            and int(manifest.get("format_version", 1)) >= 2
        )
        server = cls._build(
            client,
            size=int(manifest["size"]),
            layout=layout,
            shard_bytes=shard_bytes,
            copies=resolve_copies(kwargs.pop("copies", None), kwargs.pop("replicas", None)),
            checkpoint=target,
            storage_options=storage_options,
            init=values,
            meta=manifest.get("meta") or {},
            ack=kwargs.pop("ack", None),
            name=kwargs.pop("name", None),
            epoch=manifest.get("epoch"),
            versions=[int(v) for v in manifest["versions"]] if same_shards else None,
            manifest=manifest if keep else None,
            generation=max(manifest.get("generations") or [0]) + 1,
            marks=read_marks(url, storage_options, manifest) if same_shards else None,
        )
        if kwargs:
            raise ConfigError(f"restore() got unexpected keywords {sorted(kwargs)}")
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
            copies=info["copies"],
            ack=info["ack"],
            checkpoint=info["checkpoint"],
            storage_options=None,  # the controller sends them to no one
            layout=layout,
            meta=info["meta"],
            client=client,
        )
        server._courier.routing.set(routing)
        return server

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
        out = self._out(out)
        d = self._push_now(delta, ack, mark, out)
        pulled = {int(s) for rs in d.replies.values() for r in rs for s in r.get("pulled", ())}
        missing = [s for s in range(len(self.shards)) if s not in pulled]
        if missing:
            self.pull(missing, out=out)
        return out

    def _push_now(
        self, delta: np.ndarray, ack: str | None, mark: Mark | None, pull: np.ndarray | None
    ) -> Any:
        """Check ``delta`` once and send it to the primaries (reading the shards back into
        ``pull`` on the way)."""
        delta, nonzero, seg = self._checked(delta)
        req = Request(
            "push",
            tuple(range(len(self.shards))),
            self._rng.getrandbits(62),
            ack or self.ack,
            mark,
            values=delta,
            nonzero=nonzero,
            pull=pull is not None,
            args={} if pull is None else {"out": pull},
        )
        if seg is not None:  # released when delivered (held parts keep a lease on it)
            req.args["own_segment"] = seg
        return self._send(req)

    def _send(self, req: Request) -> Any:
        """One push through the courier: room made in the replay log first, held pushes of
        moved shards replayed, the push delivered and kept until durable (``ack="replay"``)."""
        courier = self._courier
        try:
            if req.ack == "replay":
                nbytes = 4 * sum(b - a for a, b in (self.shards[s] for s in req.sids))
                req.urgent = courier.make_room(nbytes)
            courier.replay_moved()
            d = courier.deliver(req)
        finally:
            own = req.args.pop("own_segment", None)  # the deliver did not get to it
            if own is not None:
                own.release()
        if req.ack == "replay":
            courier.keep_settling()
        return d

    def _checked(self, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        """``delta`` as a flat float32 array, which shards hold a non-zero value, and the
        segment it was copied into; :class:`UpdateRejected` when its length is wrong or it
        holds NaN/Inf: the one check of the values. A :meth:`buffer` is used where it is;
        another array is copied once into a buffer of the pool (handed over from there, and
        held from there until durable, on either transport), unless the plane is off."""
        if not (isinstance(delta, np.ndarray) and delta.dtype == np.float32 and delta.ndim == 1):
            delta = np.ascontiguousarray(delta, dtype=np.float32).reshape(-1)
        delta = np.ascontiguousarray(delta)
        if delta.shape[0] != self.size:
            raise UpdateRejected(
                f"a delta of {delta.shape[0]} values for a server of {self.size}",
                "push one value per parameter",
            )
        bad, nonzero = scan_delta(delta, self._bounds)
        channels = self._courier.channels_or_none()
        seg = None
        if bad < 0 and channels is not None and channels.pool.of(delta) is None:
            seg = channels.pool.take()  # a copy, not fused into the scan: numba's fused
            np.copyto(seg.array, delta)  # loop measured slower than the two passes
        if bad >= 0:
            sid = shard_of(self.shards, bad)
            raise UpdateRejected(
                f"non-finite update at flat index {bad} (shard {sid}); nothing was applied",
                "check the gradients for overflow",
                shard=sid,
            )
        return (delta if seg is None else seg.array), nonzero, seg

    def _out(self, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return np.zeros(self.size, dtype=np.float32)
        if out.dtype != np.float32 or out.shape != (self.size,):
            raise ConfigError(f"out must be a flat float32 array of {self.size} values")
        return out

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
        for name, m in (("errors", errors), ("activations", activations)):
            if first_nonfinite(m) >= 0:
                raise UpdateRejected(f"non-finite {name} in push_outer; nothing was applied")
        cols: dict[int, tuple[int, int]] = {}
        for s, (a, b) in enumerate(self.shards):
            p = outer_part(offset, out, inp, a, b)
            if p is not None:
                cols[s] = (p.row0, p.row1)
        if mark is not None:  # the shards this part goes to: a re-run checks each has it
            mark = replace(mark, targets=tuple(sorted(cols)))
        outer = Outer(int(offset), out, inp, float(scale), errors, activations, cols)
        self._send(
            Request(
                "push",
                tuple(sorted(cols)),
                self._rng.getrandbits(62),
                ack or self.ack,
                mark,
                outer=outer,
            )
        )

    def push_range(
        self,
        values: np.ndarray,
        start: int,
        *,
        ack: str | None = None,
        mark: Mark | None = None,
    ) -> None:
        """Add ``values`` (flat float32) to the parameters ``[start, start + len(values))``,
        sending only to the shards that overlap that range (a partition of a replica holds one
        span; a shard straddling its edge gets zeros outside it). ``mark`` as for ``push``
        (its ``targets`` become those shards). Raises :class:`UpdateRejected` (nothing
        applied) on NaN/Inf."""
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        start, stop = self._span(start, values.shape[0])
        bad = first_nonfinite(values)
        if bad >= 0:
            raise UpdateRejected(
                f"non-finite update at flat index {start + bad}; nothing was applied",
                "check the gradients for overflow (lower the learning rate)",
            )
        sids = tuple(overlapping(self.shards, start, stop))
        nonzero = {}
        for s in sids:
            a, b = self.shards[s]
            nonzero[s] = bool(values[max(a, start) - start : min(b, stop) - start].any())
        if mark is not None:
            mark = replace(mark, targets=sids)
        self._send(
            Request(
                "push",
                sids,
                self._rng.getrandbits(62),
                ack or self.ack,
                mark,
                values=values,
                base=start,
                nonzero=nonzero,
            )
        )

    def pull_range(self, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """The current parameters ``[start, stop)`` (from the primaries of the shards that
        overlap it), written into ``out`` (float32 (stop - start,), a new array if omitted)."""
        start, stop = self._span(start, int(stop) - int(start))
        if out is None:
            out = np.zeros(stop - start, np.float32)
        elif out.dtype != np.float32 or out.shape != (stop - start,):
            raise ConfigError(f"out must be a flat float32 array of {stop - start} values")
        self._pull(tuple(overlapping(self.shards, start, stop)), out, start)
        return out

    def _span(self, start: int, n: int) -> tuple[int, int]:
        start, stop = int(start), int(start) + int(n)
        if start < 0 or stop > self.size or n < 1:
            raise ConfigError(
                f"the range [{start}, {stop}) is not inside a server of {self.size} values"
            )
        return start, stop

    def _pull(self, sids: tuple[int, ...], out: np.ndarray, base: int = 0) -> None:
        courier = self._courier
        courier.replay_moved()  # a pull sees this handle's own pushes
        courier.deliver(Request("pull", sids, args={"out": out, "out_base": base}))

    def pull(
        self, shards: Iterable[int] | None = None, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The current flat parameters (from the primaries).

        With ``shards``, only those shards are fetched and written into ``out`` (a flat float32
        buffer, zeros if omitted); the rest of ``out`` is left as it is.
        """
        out = self._out(out)
        sids = range(len(self.shards)) if shards is None else sorted({int(s) for s in shards})
        for s in sids:
            if not 0 <= s < len(self.shards):
                raise ConfigError(f"no shard {s}: the server has {len(self.shards)}")
        self._pull(tuple(sids), out)
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
            versions = self._flush(timeout, durable)
            if durable:
                left = max(timeout - (time.monotonic() - t0), 1.0)
                try:
                    self._commit(epoch, meta, left)
                except TimeoutError:
                    raise StorageError(
                        f"the manifest was not written in {timeout:g}s", self._retried
                    ) from None
        except StorageError as exc:
            raise self.storage_error(exc) from exc
        if epoch is not None:
            self.epoch = epoch
        if meta is not None:
            self.meta = meta
        return versions

    _retried = "the updates are kept and written back when it answers"

    def storage_error(self, exc: BaseException) -> StorageError:
        """One line that names the checkpoint's storage (its URL without secrets) as the cause
        of ``exc``."""
        text = " ".join(str(getattr(exc, "message", None) or exc).split())
        if text.startswith("storage "):
            return exc if isinstance(exc, StorageError) else StorageError(text)
        return StorageError(
            f"storage {redact_url(str(self.checkpoint))}: {text}",
            f"{self._retried}; check its endpoint, credentials and network",
        )

    def checkpoint_meta(self, epoch: Any = None, meta: dict | None = None) -> None:
        """Store ``epoch`` and/or ``meta`` in the manifest now (no flush)."""
        if self.checkpoint is None:
            raise ConfigError("this server has no checkpoint", "create it with checkpoint=URL")
        self._commit(epoch, meta)
        if epoch is not None:
            self.epoch = epoch
        if meta is not None:
            self.meta = meta

    def stats(self) -> dict:
        """Figures from the controller and every node: ``pushes_applied`` (shard updates
        applied by primaries), ``update_rate`` (shard updates/s since the previous ``stats()``,
        or since the nodes started), ``max_replication_lag`` (versions a backup is behind its
        primary), ``writeback_lag_versions`` / ``writeback_lag_seconds`` (how far the checkpoint
        is behind), ``writeback_errors``, ``healthy``, ``heal_times``, ``restored`` (shards
        rebuilt from the checkpoint, each with ``lost_at_least``: updates after its last
        write-back the heartbeats had reported), ``updates_lost_at_least``, ``declared_dead``,
        ``refused_stale`` (calls refused for a stale generation), ``manifest_errors`` /
        ``manifest_failing`` / ``last_manifest_error`` (see :meth:`routing_info`), ``replayed`` /
        ``held_pushes`` / ``held_bytes`` (this handle's pushes sent again to a new primary, and
        those it keeps until they are durable: ``ack="replay"``), ``data_plane`` (what this
        handle sent, one count per primary a request reached: ``pushes``, ``pulls``,
        ``to_dask`` (those that went as Dask actor calls: the plane could not reach the node),
        ``failed_calls`` (plane calls given up: the node died, froze or was dropped)),
        ``nodes`` (each node's figures, ``by_transport`` among them: the pushes and pulls it
        served over the plane and as Dask actor calls; ``outer_products``: the dense offload's
        updates it computed from activations and errors)."""
        nodes, routing = self._stats()
        now = time.monotonic()
        ok = [n for n in nodes.values() if isinstance(n, dict)]
        total = sum(n["pushes"] for n in ok)
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
            "copies": self.copies,
            "replicas": self.copies,
            "pushes_applied": total,
            "update_rate": rate,
            "max_replication_lag": max((n["replication_lag"] for n in ok), default=0),
            "writeback_lag_versions": max((n["writeback_lag_versions"] for n in ok), default=0),
            "writeback_lag_seconds": max((n["writeback_lag_seconds"] for n in ok), default=0.0),
            "writeback_errors": sum(n["writeback_errors"] for n in ok),
            "healthy": routing["healthy"],
            "heal_times": routing["heal_times"],
            "generation": routing["generation"],
            "restored": routing["restored"],
            "updates_lost_at_least": sum(r["lost_at_least"] for r in routing["restored"]),
            "declared_dead": routing["declared_dead"],
            "refused_writes": routing["refused_writes"],
            "manifest_errors": routing["manifest_errors"],
            "manifest_failing": routing.get("manifest_failing", 0),
            "last_manifest_error": routing.get("last_manifest_error"),
            "refused_stale": sum(n["refused_stale"] for n in ok) + routing["refused_writes"],
            "replayed": self._courier.log.replayed,
            "held_pushes": len(self._courier.log),
            "held_bytes": self._courier.log.nbytes,
            "data_plane": (
                dict(self._courier.channels.counts) if self._courier.channels is not None else None
            ),
            "nodes": nodes,
        }

    def _flush(self, timeout: float, checkpoint: bool) -> dict[int, int]:
        """Wait for a running fail-over (up to the fail-over timeout), replay what moved, then
        have every primary wait until its copies (and ``checkpoint``) hold its shards."""
        courier = self._courier
        deadline = time.monotonic() + timeout
        wait_heal = time.monotonic() + min(timeout, float(config.get("ps.failover-timeout")))
        while True:
            courier.refresh()
            if courier.routing.healthy or time.monotonic() > wait_heal:
                break
            time.sleep(0.1)
        if not courier.routing.healthy:
            logger.warning(
                "server %s: flushing with fewer than %d copies of some shards (a "
                "PS worker is missing)",
                self.server_id,
                self.copies,
            )
        courier.replay_moved()
        remaining = max(deadline - time.monotonic(), 1.0)
        req = Request(
            "flush",
            tuple(range(len(self.shards))),
            args={"limit": remaining, "checkpoint": checkpoint},
        )
        return courier.deliver(req, call_timeout=remaining + 5).results

    def _commit(self, epoch: Any, meta: dict | None, timeout: float | None = None) -> dict:
        async def commit(rpc: Any, sched: Any) -> dict:
            coro = sched.adam_ps_commit(server_id=self.server_id, epoch=epoch, meta=meta)
            return await asyncio.wait_for(coro, timeout)

        return self._courier.control.run(commit)

    def story(self, sid: int | None = None) -> dict:
        """Why shard ``sid`` (every shard: ``None``) is where it is: ``{"controller": [...],
        "nodes": {addr: [...]}}``, each the events of note that machine handled, oldest first
        (``stimulus``, ``event``, ``shards``, ``actions``): the controller's fail-overs,
        fences, promotions and restores, each node's commands and step-downs. Bounded: the
        newest 256 events of each."""
        courier = self._courier
        courier.refresh()
        nodes = dict(courier.routing.nodes)
        answers = courier.control.each(
            {a: (k, "story", sid) for a, k in nodes.items()}, float(config.get("ps.call-timeout"))
        )
        return {
            "controller": courier.control.story(sid),
            "nodes": {
                a: (r if not isinstance(r, BaseException) else repr(r)) for a, r in answers.items()
            },
        }

    def _stats(self) -> tuple[dict, dict]:
        courier = self._courier
        routing = courier.control.routing()
        courier.routing.set(routing)
        nodes = dict(courier.routing.nodes)
        answers = courier.control.each(
            {a: (k, "stats") for a, k in nodes.items()}, float(config.get("ps.call-timeout"))
        )
        return {
            a: (r if not isinstance(r, BaseException) else repr(r)) for a, r in answers.items()
        }, routing

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
