"""ReplicaPlacement: the parameter-server controller, a scheduler plugin.

The scheduler is the single place of truth for where every shard lives: this plugin keeps, per
parameter server, the routing ``{shard: [primary, backup, backup]}`` and the PSNode actor key of
every PS worker it uses. Nobody else keeps a second map: clients and worker tasks cache the
routing and refresh it from here (the ``adam_ps_routing`` scheduler handler) whenever a node
does not answer or says a shard moved.

What it does:

* **Placement** (:func:`plan_placement`): the replicas of every shard on distinct hosts
  (distinct workers when there are too few hosts, with a warning), primaries balanced over the
  PS workers. It creates the PSNode actors itself, pinned with ``workers=[addr]``,
  ``allow_other_workers=False``, through a client of its own that lives in the scheduler, so
  the actors live as long as the scheduler does and no user client has to stay connected (a
  notebook may restart; ``ParameterServer.attach`` finds the server again).
* **Fail-over** (:meth:`ReplicaPlacement.remove_worker`): a lost PS worker is taken out of every
  routing entry at once (synchronously, before the scheduler yields), and a repair task on the
  scheduler's event loop then (1) tells live primaries to stop waiting for the lost backup,
  (2) promotes, for each shard whose primary was lost, the surviving copy with the newest
  version, (3) builds a new copy from the primary on a host the shard does not use yet
  (creating a PSNode there when needed; a worker restarted by its nanny joins with a new
  address and is used as soon as it arrives), and logs the time to heal. Repairs are
  driven here, so they happen whether or not any client listens; clients are told through the
  ``adam-ps`` event topic (``client.subscribe_topic``) and, more importantly, find the new
  routing on their next call.
* **Down-scaling**: PS workers holding shards are never offered for retirement
  (:meth:`valid_workers_downscaling`).

Register it with ``client.register_plugin(ReplicaPlacement())`` (``ParameterServer.create``
does), or for gateway/Kubernetes schedulers with ``dask scheduler --preload
adam_dask.ps.placement`` (this module's :func:`dask_setup`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from ..errors import ClusterError
from .node import PSNode, call_actor

logger = logging.getLogger(__name__)

PLUGIN_NAME = "adam-ps-placement"
TOPIC = "adam-ps"
ROLE = "PS"


# -- pure placement policy ----------------------------------------------------------------------


class PlacementWarning(UserWarning):
    """Replicas had to share a host (or there are fewer workers than replicas)."""


def plan_placement(
    n_shards: int,
    workers: dict[str, str],
    replicas: int,
    load: Counter | None = None,
    primary_load: Counter | None = None,
) -> dict[int, list[str]]:
    """{shard: [primary, backups...]} for ``n_shards`` shards over ``workers`` ({addr: host}).

    Every shard's copies go to distinct hosts while there are enough, else to distinct workers
    (a :class:`PlacementWarning`); primaries are balanced first, then total copies.
    """
    if not workers:
        raise ClusterError(
            "no parameter-server workers to place shards on",
            "start workers with the resource PS=1 (adam_dask.cluster.local does)",
        )
    load = Counter(load or {})
    primary_load = Counter(primary_load or {})
    hosts = set(workers.values())
    k = min(replicas, len(workers))
    if k < replicas:
        warnings.warn(
            f"{len(workers)} PS workers cannot hold {replicas} replicas; keeping {k}",
            PlacementWarning,
            stacklevel=2,
        )
    if len(hosts) < k:
        warnings.warn(
            f"only {len(hosts)} distinct PS hosts for {k} replicas: some copies of a "
            "shard share a host",
            PlacementWarning,
            stacklevel=2,
        )
    addrs = sorted(workers)
    plan: dict[int, list[str]] = {}
    for sid in range(n_shards):
        primary = min(
            addrs, key=lambda a: (primary_load[a], load[a], (addrs.index(a) - sid) % len(addrs))
        )
        chosen = [primary]
        primary_load[primary] += 1
        load[primary] += 1
        while len(chosen) < k:
            nxt = choose_new_holder(chosen, workers, load)
            if nxt is None:  # pragma: no cover - k <= len(workers)
                break
            chosen.append(nxt)
            load[nxt] += 1
        plan[sid] = chosen
    return plan


def choose_new_holder(holders: list[str], workers: dict[str, str], load: Counter) -> str | None:
    """The least-loaded worker on a host none of ``holders`` uses; else the least-loaded worker
    not among ``holders``; else None."""
    used_hosts = {workers.get(a) for a in holders}
    free = [a for a in sorted(workers) if a not in holders]
    best = [a for a in free if workers[a] not in used_hosts] or free
    if not best:
        return None
    return min(best, key=lambda a: (load[a], a))


def _descending(position: Any) -> Any:
    return tuple(-x for x in position) if isinstance(position, tuple) else -position


def choose_primary(versions: dict[str, Any], primary_load: Counter) -> str:
    """The copy to promote: the newest (a version, or a ``(generation, version)`` position),
    then the worker with fewest primaries."""
    return min(versions, key=lambda a: (_descending(versions[a]), primary_load[a], a))


# -- controller state ----------------------------------------------------------------------------


@dataclass
class ServerRecord:
    """What the controller knows about one parameter server."""

    server_id: str
    shards: list[tuple[int, int]]
    replicas: int
    node_config: dict
    routing: dict[int, list[str]] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)  # worker addr -> PSNode key
    futures: dict[str, Any] = field(default_factory=dict)
    needs_primary: set[int] = field(default_factory=set)
    backups_changed: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)
    generation: int = 0
    heal_started: float | None = None
    heal_times: list[float] = field(default_factory=list)
    dirty: bool = False
    task: asyncio.Task | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    info: dict = field(default_factory=dict)
    target: int = 3  # copies per shard to keep: min(replicas, PS workers at creation)


def _controller_security(scheduler):
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


class ReplicaPlacement(SchedulerPlugin):
    """The PS controller (see the module doc). One instance serves every parameter server."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, role: str = ROLE):
        self.role = role
        self.servers: dict[str, ServerRecord] = {}
        self.scheduler = None
        self._client = None
        self._client_lock: asyncio.Lock | None = None
        self._counter = itertools.count()

    # -- plugin hooks ----------------------------------------------------------------------------

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._client_lock = asyncio.Lock()
        scheduler.handlers.update(
            {
                "adam_ps_create": self.create_server,
                "adam_ps_routing": self.routing,
                "adam_ps_close": self.close_server,
                "adam_ps_servers": self.list_servers,
            }
        )

    async def before_close(self) -> None:
        for rec in list(self.servers.values()):
            if rec.task is not None:
                rec.task.cancel()
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await client.close(timeout=2)
            except Exception:  # pragma: no cover - shutting down
                pass

    def remove_worker(
        self, scheduler: Any, worker: str, *, stimulus_id: str | None = None, **kwargs: Any
    ) -> None:
        for rec in self.servers.values():
            touched = []
            was_node = rec.nodes.pop(worker, None) is not None
            rec.futures.pop(worker, None)
            for sid, holders in rec.routing.items():
                if worker not in holders:
                    continue
                touched.append(sid)
                if holders[0] == worker and sid not in rec.needs_primary:
                    rec.needs_primary.add(sid)
                holders.remove(worker)
                if sid not in rec.needs_primary:
                    rec.backups_changed.add(sid)
            if not touched and not was_node:
                continue
            rec.generation += 1
            if rec.heal_started is None:
                rec.heal_started = time.monotonic()
            lost_primaries = sorted(s for s in touched if s in rec.needs_primary)
            logger.warning(
                "PS worker %s lost: server %s lost %d replica(s), %d primaries; repairing",
                worker,
                rec.server_id,
                len(touched),
                len(lost_primaries),
            )
            scheduler.log_event(
                TOPIC,
                {
                    "event": "worker-lost",
                    "server": rec.server_id,
                    "worker": worker,
                    "shards": touched,
                    "primaries": lost_primaries,
                    "generation": rec.generation,
                },
            )
            self._kick(rec)

    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is None or not ws.resources.get(self.role):
            return
        for rec in self.servers.values():
            if not self._healthy(rec):
                self._kick(rec)

    def valid_workers_downscaling(self, scheduler: Any, workers: list) -> list:
        busy = {a for rec in self.servers.values() for hs in rec.routing.values() for a in hs}
        keep = [ws for ws in workers if ws.address not in busy]
        if len(keep) < len(workers):
            logger.info(
                "not down-scaling %d PS worker(s) that hold shards", len(workers) - len(keep)
            )
        return keep

    # -- helpers ---------------------------------------------------------------------------------

    def _ps_workers(self) -> dict[str, str]:
        """{addr: host} of the running PS workers."""
        return {ws.address: ws.host for ws in self.scheduler.running if ws.resources.get(self.role)}

    def _healthy(self, rec: ServerRecord) -> bool:
        """Every shard has a primary and its full number of copies (``replicas``, or as many
        as there were PS workers when the server was made)."""
        want = rec.target
        return not rec.needs_primary and all(
            len(h) >= want for s, h in rec.routing.items() if s not in rec.lost
        )

    async def _call(self, addr: str, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return await call_actor(
            self.scheduler.rpc, addr, key, method, *args, timeout=float(self._timeout), **kwargs
        )

    @property
    def _timeout(self) -> float:
        from .. import config

        return float(config.get("ps.call-timeout"))

    async def _get_client(self):
        async with self._client_lock:
            if self._client is None:
                from distributed import Client

                self._client = await Client(
                    self.scheduler.address,
                    asynchronous=True,
                    set_as_default=False,
                    direct_to_workers=True,
                    security=_controller_security(self.scheduler),
                    name="adam-ps-controller",
                )
            return self._client

    async def _ensure_node(self, rec: ServerRecord, addr: str) -> str:
        """The key of ``rec``'s PSNode on ``addr``, creating the actor (pinned) if needed."""
        if addr in rec.nodes:
            return rec.nodes[addr]
        client = await self._get_client()
        key = f"adam-ps-{rec.server_id}-node{next(self._counter)}"
        fut = client.submit(
            PSNode,
            rec.server_id,
            rec.node_config,
            actor=True,
            key=key,
            workers=[addr],
            allow_other_workers=False,
            pure=False,
        )
        try:
            await asyncio.wait_for(fut, self._timeout)
        except BaseException:
            fut.release()
            raise
        if addr not in self._ps_workers():  # lost while we waited
            fut.release()
            raise OSError(f"PS worker {addr} left while its node was created")
        rec.nodes[addr] = key
        rec.futures[addr] = fut
        return key

    def _kick(self, rec: ServerRecord) -> None:
        rec.dirty = True
        if rec.task is None or rec.task.done():
            rec.task = asyncio.ensure_future(self._repair_loop(rec))

    async def _repair_loop(self, rec: ServerRecord) -> None:
        failures = 0
        while rec.dirty and rec.server_id in self.servers:
            rec.dirty = False
            try:
                async with rec.lock:
                    progress = await self._repair_once(rec)
                failures = 0
            except Exception:
                failures += 1
                logger.exception(
                    "repair of server %s failed (attempt %d); retrying", rec.server_id, failures
                )
                await asyncio.sleep(min(0.2 * 2**failures, 5.0))
                rec.dirty = True
                continue
            if self._healthy(rec):
                if rec.heal_started is not None:
                    took = time.monotonic() - rec.heal_started
                    rec.heal_started = None
                    rec.heal_times.append(took)
                    logger.warning(
                        "server %s healed: every shard has %d replicas again, %.2fs after the loss",
                        rec.server_id,
                        rec.replicas,
                        took,
                    )
                    self.scheduler.log_event(
                        TOPIC,
                        {
                            "event": "healed",
                            "server": rec.server_id,
                            "seconds": took,
                            "generation": rec.generation,
                        },
                    )
            elif progress:
                rec.dirty = True  # more to do now
            else:
                # waiting for a PS worker to (re)join (a nanny restarts a killed one under a new
                # address); add_worker kicks us too, but a worker may not be "running" yet then
                await asyncio.sleep(0.25)
                rec.dirty = True

    async def _repair_once(self, rec: ServerRecord) -> bool:
        """One pass of fail-over; True when it changed something."""
        progress = False
        logger.debug(
            "server %s: repair pass; needs primary %s, backups changed %s",
            rec.server_id,
            sorted(rec.needs_primary),
            sorted(rec.backups_changed),
        )
        # 1. live primaries stop waiting for (and forwarding to) lost backups
        calls: dict[str, dict[int, list]] = {}
        for sid in sorted(rec.backups_changed - rec.needs_primary):
            holders = rec.routing[sid]
            if holders:
                calls.setdefault(holders[0], {})[sid] = [(a, rec.nodes[a]) for a in holders[1:]]
        rec.backups_changed.clear()
        await self._gather_calls(rec, "set_backups", calls)

        # 2. promote the newest surviving copy of shards that lost their primary
        if rec.needs_primary:
            asked: dict[str, list[int]] = {}
            for sid in rec.needs_primary:
                for a in rec.routing[sid]:
                    asked.setdefault(a, []).append(sid)
            versions = await self._gather_calls(rec, "versions", {a: s for a, s in asked.items()})
            logger.debug("server %s: versions of the survivors %s", rec.server_id, versions)
            primary_load = Counter(
                h[0] for s, h in rec.routing.items() if h and s not in rec.needs_primary
            )
            promote: dict[str, dict[int, list]] = {}
            for sid in sorted(rec.needs_primary):
                cands = {
                    a: versions[a][sid]
                    for a in rec.routing[sid]
                    if isinstance(versions.get(a), dict) and sid in versions[a]
                }
                if not rec.routing[sid]:
                    rec.lost.add(sid)
                    rec.needs_primary.discard(sid)
                    logger.error("server %s: every copy of shard %d is lost", rec.server_id, sid)
                    self.scheduler.log_event(
                        TOPIC, {"event": "shard-lost", "server": rec.server_id, "shard": sid}
                    )
                    continue
                if not cands:
                    continue
                new = choose_primary(cands, primary_load)
                primary_load[new] += 1
                others = [a for a in rec.routing[sid] if a != new]
                promote.setdefault(new, {})[sid] = [(a, rec.nodes[a]) for a in others]
            done = await self._gather_calls(rec, "promote", promote)
            for addr, res in done.items():
                if not isinstance(res, dict):
                    continue
                for sid in promote[addr]:
                    if addr in rec.routing[sid]:
                        rec.routing[sid] = [addr] + [a for a in rec.routing[sid] if a != addr]
                        rec.needs_primary.discard(sid)
                        progress = True
                        logger.info(
                            "server %s: shard %d promoted on %s (version %s)",
                            rec.server_id,
                            sid,
                            addr,
                            res.get(sid),
                        )
            if progress:
                rec.generation += 1

        # 3. new copies for shards with too few
        live = self._ps_workers()
        load = Counter(a for h in rec.routing.values() for a in h)
        adds: dict[str, dict[int, list]] = {}
        targets: dict[str, dict[int, list[str]]] = {}
        want = rec.target
        for sid, holders in sorted(rec.routing.items()):
            if sid in rec.needs_primary or sid in rec.lost or not holders:
                continue
            chosen: list[str] = []
            while len(holders) + len(chosen) < want:
                t = choose_new_holder(holders + chosen, live, load)
                if t is None:
                    break
                used = {live.get(a) for a in holders + chosen}
                if live[t] in used:
                    logger.warning(
                        "server %s: shard %d gets a copy on host %s, which already "
                        "holds one (too few PS hosts)",
                        rec.server_id,
                        sid,
                        live[t],
                    )
                chosen.append(t)
                load[t] += 1
            if chosen:
                targets.setdefault(holders[0], {})[sid] = chosen
        if targets:
            need = sorted({a for d in targets.values() for ts in d.values() for a in ts})
            made = await asyncio.gather(
                *(self._ensure_node(rec, a) for a in need), return_exceptions=True
            )
            ok = {a: k for a, k in zip(need, made) if isinstance(k, str)}
            for a, k in zip(need, made):
                if not isinstance(k, str):
                    logger.warning("server %s: no PS node on %s (%s)", rec.server_id, a, k)
            for p, d in targets.items():
                for sid, ts in d.items():
                    bs = [(a, ok[a]) for a in ts if a in ok]
                    if bs:
                        adds.setdefault(p, {})[sid] = bs
            done = await self._gather_calls(rec, "add_backups", adds, limit=self._timeout)
            for p, res in done.items():
                if not isinstance(res, dict):
                    continue
                for sid, bs in adds[p].items():
                    holders = rec.routing[sid]
                    if holders and holders[0] == p:
                        for a, _ in bs:
                            if a in rec.nodes and a not in holders:
                                holders.append(a)
                                progress = True
            if progress:
                rec.generation += 1
        return progress

    async def _gather_calls(
        self, rec: ServerRecord, method: str, calls: dict[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        """Call ``method(arg)`` on the node of each address in ``calls`` ({addr: arg});
        {addr: result or exception}."""
        addrs = [a for a in calls if a in rec.nodes]
        res = await asyncio.gather(
            *(self._call(a, rec.nodes[a], method, calls[a], **kwargs) for a in addrs),
            return_exceptions=True,
        )
        out = {}
        for a, r in zip(addrs, res):
            if isinstance(r, BaseException):
                logger.warning(
                    "server %s: %s on %s failed: %s: %s",
                    rec.server_id,
                    method,
                    a,
                    type(r).__name__,
                    r,
                )
            out[a] = r
        return out

    # -- scheduler handlers (called by ParameterServer) -------------------------------------------

    async def create_server(
        self,
        server_id: str,
        shards: list,
        replicas: int,
        node_config: dict,
        info: dict | None = None,
    ) -> dict:
        """Place and create the nodes of a new server; returns its routing."""
        if server_id in self.servers:
            raise ValueError(f"a parameter server {server_id!r} exists already")
        live = self._ps_workers()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = plan_placement(len(shards), live, int(replicas))
        for w in caught:
            logger.warning("server %s: %s", server_id, w.message)
        rec = ServerRecord(
            server_id,
            [tuple(s) for s in shards],
            int(replicas),
            dict(node_config),
            routing={s: list(h) for s, h in plan.items()},
            info=dict(info or {}),
            target=min(int(replicas), len(live)),
        )
        self.servers[server_id] = rec
        try:
            addrs = sorted({a for h in plan.values() for a in h})
            await asyncio.gather(*(self._ensure_node(rec, a) for a in addrs))
            calls = {}
            for a in addrs:
                held = {s: rec.shards[s] for s, h in plan.items() if a in h}
                prim = {s: [(b, rec.nodes[b]) for b in h[1:]] for s, h in plan.items() if h[0] == a}
                calls[a] = (held, prim)
            await asyncio.gather(*(self._call(a, rec.nodes[a], "assign", *calls[a]) for a in addrs))
        except BaseException:
            await self.close_server(server_id)
            raise
        logger.info(
            "server %s: %d shards x %d replicas on %d PS workers",
            server_id,
            len(shards),
            replicas,
            len(addrs),
        )
        return self.routing(server_id)

    def routing(self, server_id: str) -> dict:
        """The routing of a server: ``routing`` (list by shard of [primary, backups...]),
        ``nodes`` ({addr: key}), ``pending`` (shards waiting for a new primary), ``lost``,
        ``healthy`` (every shard has ``target`` copies), ``target``, ``generation``,
        ``heal_times`` (seconds from each loss to healthy again), ``info``."""
        rec = self.servers.get(server_id)
        if rec is None:
            raise KeyError(f"no parameter server {server_id!r} on this scheduler")
        return {
            "routing": [list(rec.routing[s]) for s in range(len(rec.shards))],
            "nodes": dict(rec.nodes),
            "pending": sorted(rec.needs_primary),
            "target": rec.target,
            "lost": sorted(rec.lost),
            "healthy": self._healthy(rec),
            "generation": rec.generation,
            "heal_times": list(rec.heal_times),
            "info": rec.info,
        }

    def list_servers(self) -> list[str]:
        return sorted(self.servers)

    async def close_server(self, server_id: str) -> None:
        """Stop and release the nodes of a server."""
        rec = self.servers.pop(server_id, None)
        if rec is None:
            return
        if rec.task is not None:
            rec.task.cancel()
        await asyncio.gather(
            *(self._call(a, k, "close") for a, k in rec.nodes.items()), return_exceptions=True
        )
        for fut in rec.futures.values():
            fut.release()
        logger.info("server %s closed", server_id)


def dask_setup(scheduler: Any) -> None:
    """Scheduler preload hook: ``dask scheduler --preload adam_dask.ps.placement``."""
    scheduler.add_plugin(ReplicaPlacement())
