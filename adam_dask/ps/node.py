"""PSNode: the parameter-server actor, one per PS worker and server, holding shard replicas.

A node holds, for one :class:`~adam_dask.ps.server.ParameterServer`, the *primary* copy of some
shards and *backup* copies of others (:class:`~adam_dask.ps.state.ShardState` each). All methods
are ``async``: they run on the worker's event loop, interleave only at ``await``, and so touch the
shard state from one thread without locks (CPU-heavy outer products are computed in a thread and
applied back on the loop).

Update path (primary): ``push`` checks the deltas (NaN/Inf are refused, nothing changes),
queues them, and one drain per loop iteration applies every queued delta of a shard as one
blocked batch; each push gets its own version. With ``ack="primary"`` the push is acknowledged
once applied; with ``ack="all"`` once every current backup holds its version.

Replication: one forwarder task per backup address sends, every ``forward-interval`` (at once
when an ``ack="all"`` push waits), the newest values of every shard that changed since the
backup's last acknowledged version, in one call: updates are folded into the newest values, so
a backup that missed anything simply catches up with the next copy. Push ids travel with the
copies, so a push retried on a promoted backup after a fail-over is applied once.

Write-back: a writer task writes dirty primaries to the checkpoint every
``writeback-interval`` (see :mod:`adam_dask.ps.checkpoint`), off the update path.

The node never decides placement: the scheduler plugin (:mod:`adam_dask.ps.placement`) tells it
which shards it holds and in which role (``assign``, ``promote``, ``set_backups``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from distributed.protocol import to_serialize
from distributed.protocol.serialize import Serialized, deserialize

from ..errors import StorageError, UpdateRejected
from .state import ShardState, Snapshot

logger = logging.getLogger(__name__)

Backup = tuple[str, str]  # (worker address, node actor key)


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


class PSNode:
    """The shard replicas of one parameter server on one PS worker (a Dask actor).

    Parameters
    ----------
    server_id : str
        The server this node belongs to.
    config : dict
        ``forward_interval``, ``writeback_interval``, ``retry_base``, ``retry_max``,
        ``call_timeout``, ``ack`` (default acknowledgement), ``dedup_window``, ``checkpoint``
        (URL or None), ``storage_options``, ``shard_bytes``, ``size``.
    """

    def __init__(self, server_id: str, config: dict):
        self.server_id = server_id
        self.cfg = dict(config)
        self.shards: dict[int, ShardState] = {}
        self.backups: dict[int, list[Backup]] = {}  # primaries only: sid -> its backups
        self.acked: dict[str, dict[int, int]] = {}  # backup addr -> sid -> version it holds
        self.written: dict[int, int] = {}  # sid -> version in the checkpoint
        self._queue: dict[int, list[tuple[np.ndarray, int | None, asyncio.Future]]] = {}
        self._drain_scheduled = False
        self._waiters: dict[int, list[tuple[int, asyncio.Future]]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._forwarders: dict[str, asyncio.Task] = {}
        self._writer_task: asyncio.Task | None = None
        self._write_now: asyncio.Event | None = None
        self._written_cond: asyncio.Condition | None = None
        self._snap_cache: dict[int, tuple[int, np.ndarray]] = {}
        self._worker = None
        self._closed = False
        self._started = time.time()
        self.pushes = 0
        self.floats_applied = 0
        self.last_write = time.time()
        self.writeback_errors = 0
        self.last_writeback_error: str | None = None
        self.forward_errors = 0
        self._checkpoint = None

    def __repr__(self) -> str:
        return (
            f"PSNode({self.server_id}, primaries={sorted(self.backups)}, "
            f"backups={sorted(set(self.shards) - set(self.backups))})"
        )

    # -- plumbing --------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._worker is not None:
            return
        from distributed import get_worker

        self._worker = get_worker()
        self._write_now = asyncio.Event()
        self._written_cond = asyncio.Condition()
        if self.cfg.get("checkpoint"):
            from .checkpoint import CheckpointWriter

            self._checkpoint = CheckpointWriter(
                self.cfg["checkpoint"], self.cfg.get("storage_options")
            )
            self._writer_task = asyncio.ensure_future(self._writeback_loop())

    async def _call(self, addr: str, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return await call_actor(
            self._worker.rpc,
            addr,
            key,
            method,
            *args,
            timeout=self.cfg.get("call_timeout"),
            **kwargs,
        )

    def _sync_forwarders(self) -> None:
        wanted = {a for bs in self.backups.values() for a, _ in bs}
        for addr in wanted:
            if addr not in self._forwarders or self._forwarders[addr].done():
                self._wake[addr] = asyncio.Event()
                self.acked.setdefault(addr, {})
                self._forwarders[addr] = asyncio.ensure_future(self._forward_loop(addr))
        for addr in list(self._forwarders):
            if addr not in wanted:
                self._forwarders.pop(addr).cancel()
                self._wake.pop(addr, None)
                self.acked.pop(addr, None)

    # -- role changes (called by the placement plugin) ------------------------------------------

    async def assign(
        self, shards: dict, backups: dict, values: dict | None = None, version: int = 0
    ) -> None:
        """Hold ``shards`` ({sid: (start, stop)}); be primary of those in ``backups``
        ({sid: [(addr, key), ...]}). ``values`` ({sid: array}) sets initial values."""
        self._start()
        for sid, (start, stop) in shards.items():
            sid = int(sid)
            if sid not in self.shards:
                v = None if values is None else values.get(sid)
                self.shards[sid] = ShardState(
                    sid, start, stop, v, version, self.cfg.get("dedup_window", 8192)
                )
                self.written[sid] = version
        for sid, bs in backups.items():
            self.backups[int(sid)] = [tuple(b) for b in bs]
        self._sync_forwarders()

    async def load(self, items: dict, version: int | dict = 0, clean: bool = True) -> None:
        """Overwrite values: {sid: array} at ``version`` (an int, or {sid: version}), for initial
        values and restore. ``clean`` marks them as already in the checkpoint."""
        self._start()
        for sid, values in items.items():
            sid = int(sid)
            st = self.shards[sid]
            v = np.asarray(values, dtype=np.float32).reshape(-1)
            if v.shape[0] != st.size:
                raise UpdateRejected(
                    f"shard {sid}: {v.shape[0]} values for {st.size} floats", shard=sid
                )
            st.values[:] = v
            st.version = int(version[sid] if isinstance(version, dict) else version)
            self._snap_cache.pop(sid, None)
            if clean:
                self.written[sid] = st.version
            for acked in self.acked.values():
                acked.pop(sid, None)

    async def versions(self, sids: Iterable[int] | None = None) -> dict[int, int]:
        """{sid: version} of the shards held here (all, or ``sids``)."""
        sids = self.shards if sids is None else [int(s) for s in sids if int(s) in self.shards]
        return {s: self.shards[s].version for s in sids}

    async def promote(self, sids_backups: dict) -> dict[int, int]:
        """Become primary of each shard in {sid: [(addr, key), ...]}; returns their versions."""
        self._start()
        out = {}
        for sid, bs in sids_backups.items():
            sid = int(sid)
            self.backups[sid] = [tuple(b) for b in bs]
            self.written[sid] = -1  # the checkpoint may be older or newer: write ours
            self._snap_cache.pop(sid, None)
            for acked in self.acked.values():
                acked.pop(sid, None)
            out[sid] = self.shards[sid].version
            logger.info(
                "node %s: promoted to primary of shard %d at version %d",
                self._worker.address,
                sid,
                out[sid],
            )
        self._sync_forwarders()
        for addr in self._wake:
            self._wake[addr].set()
        return out

    async def set_backups(self, sids_backups: dict) -> None:
        """Replace the backup lists of primaries ({sid: [(addr, key), ...]})."""
        for sid, bs in sids_backups.items():
            sid = int(sid)
            if sid in self.backups:
                self.backups[sid] = [tuple(b) for b in bs]
        self._sync_forwarders()
        for sid in sids_backups:
            self._check_waiters(int(sid))

    async def add_backups(self, sids_backups: dict, limit: float | None = None) -> dict[int, int]:
        """Add backups to primaries ({sid: [(addr, key), ...]}) and wait until each holds the
        shard's current version (a full copy is sent). Returns the versions they hold."""
        for sid, bs in sids_backups.items():
            sid = int(sid)
            cur = self.backups.setdefault(sid, [])
            for b in bs:
                if tuple(b) not in cur:
                    cur.append(tuple(b))
        self._sync_forwarders()
        waits = []
        for sid in sids_backups:
            sid = int(sid)
            waits.append(self._wait_replicated(sid, self.shards[sid].version))
        await asyncio.wait_for(asyncio.gather(*waits), limit)
        return {int(s): self.shards[int(s)].version for s in sids_backups}

    async def drop(self, sids: Iterable[int]) -> None:
        """Forget shards (a replica moved away)."""
        for sid in sids:
            self.shards.pop(int(sid), None)
            self.backups.pop(int(sid), None)
        self._sync_forwarders()

    async def close(self) -> None:
        """Stop the background tasks (called before the actor is released)."""
        self._closed = True
        for t in list(self._forwarders.values()) + (
            [self._writer_task] if self._writer_task else []
        ):
            t.cancel()
        self._forwarders.clear()

    # -- update path -----------------------------------------------------------------------------

    async def push(self, deltas: dict, push_id: int | None = None, ack: str | None = None) -> dict:
        """Add {sid: delta} to the primaries held here.

        Returns ``{"per_shard": {sid: version}, "moved": [sid, ...]}``; ``moved`` lists shards this
        node is not the primary of (the caller refreshes its routing and retries them). Raises
        :class:`UpdateRejected` (nothing applied) when any delta is bad.
        """
        moved = [int(s) for s in deltas if int(s) not in self.backups]
        checked = {
            int(s): self.shards[int(s)].check(d)
            for s, d in deltas.items()
            if int(s) in self.backups
        }
        return await self._apply(checked, moved, push_id, ack)

    async def push_outer(
        self,
        parts: dict,
        offset: int,
        out: int,
        inp: int,
        activations: np.ndarray,
        scale: float = 1.0,
        push_id: int | None = None,
        ack: str | None = None,
    ) -> dict:
        """Add each shard's part of ``scale * errors.T @ activations``; ``parts`` maps
        sid -> the error columns of the rows touching it. The product is computed here, in a
        thread; the result is applied like a push."""
        moved = [int(s) for s in parts if int(s) not in self.backups]
        todo = {int(s): e for s, e in parts.items() if int(s) not in moved}

        def compute() -> dict[int, np.ndarray]:
            return {
                s: self.shards[s].outer_as_delta(offset, out, inp, e, activations, scale)
                for s, e in todo.items()
            }

        deltas = await asyncio.to_thread(compute) if todo else {}
        return await self._apply(deltas, moved, push_id, ack)

    async def _apply(
        self, deltas: dict[int, np.ndarray], moved: list[int], push_id: int | None, ack: str | None
    ) -> dict:
        loop = asyncio.get_running_loop()
        futs = {}
        for sid, d in deltas.items():
            fut = loop.create_future()
            self._queue.setdefault(sid, []).append((d, push_id, fut))
            futs[sid] = fut
        if futs and not self._drain_scheduled:
            self._drain_scheduled = True
            loop.call_soon(self._drain)
        versions = {sid: await f for sid, f in futs.items()}
        if (ack or self.cfg["ack"]) == "all":
            await asyncio.gather(*(self._wait_replicated(s, v) for s, v in versions.items()))
        return {
            "per_shard": versions,
            "moved": moved,
            "confirmed": {s: self._confirmed(s) for s in versions},
        }

    def _confirmed(self, sid: int) -> int:
        """The newest version of primary ``sid`` that every current backup holds."""
        held = [self.acked.get(a, {}).get(sid, -1) for a, _ in self.backups.get(sid, [])]
        return min([self.shards[sid].version, *held])

    async def confirmed(self, sids: Iterable[int]) -> dict:
        """``{"per_shard": {sid: version held by every copy}, "moved": [...]}`` for the
        primaries among ``sids`` (a pusher drops the pushes it kept up to that version)."""
        sids = [int(s) for s in sids]
        return {
            "per_shard": {s: self._confirmed(s) for s in sids if s in self.backups},
            "moved": [s for s in sids if s not in self.backups],
        }

    def _drain(self) -> None:
        """Apply every queued delta, one blocked batch per shard."""
        self._drain_scheduled = False
        queue, self._queue = self._queue, {}
        for sid, items in queue.items():
            st = self.shards.get(sid)
            if st is None or sid not in self.backups:
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(UpdateRejected(f"shard {sid} moved", shard=sid))
                continue
            try:
                versions = st.apply_batch([d for d, _, _ in items], [p for _, p, _ in items])
            except Exception as exc:  # pragma: no cover - deltas were checked on arrival
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.pushes += len(items)
            self.floats_applied += len(items) * st.size
            for (_, _, fut), v in zip(items, versions):
                if not fut.done():
                    fut.set_result(v)

    async def pull(self, sids: Iterable[int] | None = None) -> dict:
        """``{"per_shard": {sid: values}, "moved": [...]}`` for the primaries among ``sids``."""
        sids = list(self.backups) if sids is None else [int(s) for s in sids]
        moved = [s for s in sids if s not in self.backups]
        return {
            "per_shard": {s: self._values_of(s)[1] for s in sids if s in self.backups},
            "moved": moved,
        }

    async def pull_versions(self, sids: Iterable[int]) -> dict:
        """``{"per_shard": {sid: version}, "moved": [...]}`` for the primaries among ``sids``."""
        sids = [int(s) for s in sids]
        return {
            "per_shard": {s: self.shards[s].version for s in sids if s in self.backups},
            "moved": [s for s in sids if s not in self.backups],
        }

    def _values_of(self, sid: int) -> tuple[int, np.ndarray]:
        """(version, an immutable copy of the values), cached per version."""
        st = self.shards[sid]
        cached = self._snap_cache.get(sid)
        if cached is None or cached[0] != st.version:
            cached = (st.version, st.values.copy())
            self._snap_cache[sid] = cached
        return cached

    # -- replication -----------------------------------------------------------------------------

    async def replicate(self, snaps: list[Snapshot]) -> dict[int, int]:
        """Take newer copies from a primary; returns {sid: version held now}."""
        self._start()
        out = {}
        for snap in snaps:
            st = self.shards.get(snap.shard)
            if st is None:
                st = self.shards[snap.shard] = ShardState(
                    snap.shard, snap.start, snap.stop, None, -1, self.cfg.get("dedup_window", 8192)
                )
            if snap.shard not in self.backups:  # never overwrite a primary
                st.install(snap.version, snap.values, snap.ids)
            out[snap.shard] = st.version
        return out

    def _wait_replicated(self, sid: int, version: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(sid, []).append((version, fut))
        for addr, _ in self.backups.get(sid, []):
            if addr in self._wake:
                self._wake[addr].set()
        self._check_waiters(sid)
        return fut

    def _check_waiters(self, sid: int) -> None:
        waiters = self._waiters.get(sid)
        if not waiters:
            return
        bs = self.backups.get(sid, [])
        held = min((self.acked.get(a, {}).get(sid, -1) for a, _ in bs), default=float("inf"))
        keep = []
        for v, fut in waiters:
            if fut.done():
                continue
            if held >= v or sid not in self.backups:
                fut.set_result(None)
            else:
                keep.append((v, fut))
        self._waiters[sid] = keep

    async def _forward_loop(self, addr: str) -> None:
        interval = float(self.cfg.get("forward_interval", 0.05))
        failures = 0
        wake = self._wake[addr]
        while not self._closed:
            try:
                await asyncio.wait_for(wake.wait(), interval)
            except TimeoutError:
                pass
            wake.clear()
            acked = self.acked.setdefault(addr, {})
            key = None
            snaps = []
            for sid, bs in self.backups.items():
                for a, k in bs:
                    if a == addr:
                        key = k
                        st = self.shards[sid]
                        base = acked.get(sid, -1)
                        if base < st.version:
                            version, values = self._values_of(sid)
                            snaps.append(
                                Snapshot(
                                    sid, st.start, st.stop, version, values, st.ids_since(base)
                                )
                            )
            if not snaps or key is None:
                continue
            try:
                held = await self._call(addr, key, "replicate", snaps)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.forward_errors += 1
                delay = min(float(self.cfg.get("retry_base", 0.2)) * 2 ** (failures - 1), 2.0)
                logger.warning(
                    "node %s: forwarding %d shard(s) to backup %s failed (%s: %s); "
                    "retrying in %.1fs",
                    self._worker.address,
                    len(snaps),
                    addr,
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            failures = 0
            for sid, v in held.items():
                acked[int(sid)] = max(acked.get(int(sid), -1), int(v))
                self._check_waiters(int(sid))

    # -- checkpoint write-back -------------------------------------------------------------------

    async def _writeback_loop(self) -> None:
        interval = float(self.cfg.get("writeback_interval", 1.0))
        base, cap = float(self.cfg.get("retry_base", 0.2)), float(self.cfg.get("retry_max", 5.0))
        failures = 0
        while not self._closed:
            try:
                await asyncio.wait_for(self._write_now.wait(), interval)
            except TimeoutError:
                pass
            self._write_now.clear()
            dirty = [s for s in self.backups if self.shards[s].version > self.written.get(s, -1)]
            if not dirty:
                self.last_write = time.time()
                async with self._written_cond:
                    self._written_cond.notify_all()
                continue
            snaps = []
            for sid in dirty:
                st = self.shards[sid]
                version, values = self._values_of(sid)
                snaps.append(Snapshot(sid, st.start, st.stop, version, values))
            try:
                await asyncio.to_thread(self._checkpoint.write, snaps)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.writeback_errors += 1
                self.last_writeback_error = f"{type(exc).__name__}: {exc}"
                delay = min(base * 2 ** (failures - 1), cap)
                logger.warning(
                    "node %s: checkpoint write-back of %d shard(s) failed (attempt "
                    "%d, %s); retrying in %.1fs, nothing is dropped",
                    self._worker.address,
                    len(snaps),
                    failures,
                    self.last_writeback_error,
                    delay,
                )
                try:
                    self._worker.log_event(
                        "adam-ps-checkpoint",
                        {
                            "server": self.server_id,
                            "worker": self._worker.address,
                            "error": self.last_writeback_error,
                            "attempt": failures,
                            "shards": dirty,
                        },
                    )
                except Exception:  # pragma: no cover - reporting must not break the loop
                    pass
                await asyncio.sleep(delay)
                self._write_now.set()
                continue
            if failures:
                logger.info(
                    "node %s: checkpoint write-back succeeded after %d failed attempt(s)",
                    self._worker.address,
                    failures,
                )
            failures = 0
            for snap in snaps:
                self.written[snap.shard] = max(self.written.get(snap.shard, -1), snap.version)
            self.last_write = time.time()
            async with self._written_cond:
                self._written_cond.notify_all()

    async def flush(self, sids: Iterable[int] | None = None, limit: float | None = None) -> dict:
        """Wait until every backup holds the current version of the primaries ``sids`` (all by
        default) and the checkpoint does too. Returns ``{"per_shard": {sid: version},
        "moved": [...]}``; raises :class:`StorageError` after ``limit`` seconds."""
        self._start()
        sids = list(self.backups) if sids is None else [int(s) for s in sids]
        moved = [s for s in sids if s not in self.backups]
        target = {s: self.shards[s].version for s in sids if s in self.backups}

        async def replicated() -> None:
            await asyncio.gather(*(self._wait_replicated(s, v) for s, v in target.items()))

        async def written() -> None:
            if self._checkpoint is None:
                return
            async with self._written_cond:
                while not all(
                    self.written.get(s, -1) >= v for s, v in target.items() if s in self.backups
                ):
                    self._write_now.set()
                    await self._written_cond.wait()

        try:
            await asyncio.wait_for(asyncio.gather(replicated(), written()), limit)
        except TimeoutError:
            raise StorageError(
                f"flush on {self._worker.address} did not finish in {limit}s "
                f"(last write-back error: {self.last_writeback_error})",
                "check the checkpoint storage; the updates are kept and retried",
            ) from None
        return {"per_shard": target, "moved": moved}

    # -- introspection ---------------------------------------------------------------------------

    async def stats(self) -> dict:
        """Counters and lags of this node (see ParameterServer.stats)."""
        now = time.time()
        repl_lag = 0
        for sid, bs in self.backups.items():
            v = self.shards[sid].version
            for a, _ in bs:
                repl_lag = max(repl_lag, v - self.acked.get(a, {}).get(sid, -1))
        wb_versions = max(
            (self.shards[s].version - self.written.get(s, -1) for s in self.backups), default=0
        )
        return {
            "address": self._worker.address if self._worker else None,
            "primaries": sorted(self.backups),
            "backups": sorted(set(self.shards) - set(self.backups)),
            "pushes": self.pushes,
            "floats_applied": self.floats_applied,
            "uptime": now - self._started,
            "replication_lag": int(repl_lag),
            "writeback_lag_versions": int(max(wb_versions, 0)),
            "writeback_lag_seconds": (now - self.last_write) if wb_versions > 0 else 0.0,
            "writeback_errors": self.writeback_errors,
            "last_writeback_error": self.last_writeback_error,
            "forward_errors": self.forward_errors,
            "versions": {s: st.version for s, st in self.shards.items()},
        }
