"""ShardPlacement: the parameter-server controller, a scheduler plugin.

The decisions live in :class:`~adam_dask.ps.protocol.controller.ServerState` (pure, one per server);
this plugin feeds it events (workers joining and leaving, heartbeats, write-back reports,
answers of calls, a timer) and carries its actions out on the scheduler's event loop: calls to
nodes, node creation, retiring a silent worker, writing the manifest. The scheduler is the one
place of truth for where every shard lives: clients and worker tasks cache the routing and read
it again (the ``adam_ps_routing`` handler) whenever a node does not answer or says a shard moved.

The PSNode actors are made by a client of the plugin's own inside the scheduler, pinned with
``workers=[addr]``, so they live as long as the scheduler does and no user client has to stay
connected (``ParameterServer.attach`` finds a server again). PS workers holding shards are never
offered for down-scaling.

Register it with ``client.register_plugin(ShardPlacement())`` (``ParameterServer.create`` does),
or preload it: ``dask scheduler --preload adam_dask.ps``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from dataclasses import replace
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from ... import config
from ..._secrets import install, process_redactor, redact_url, redact_urls, remember
from ..protocol.controller import ServerState
from ..protocol.controller_machine import handle
from ..protocol.messages import (
    Beat,
    Call,
    CallDone,
    CallFailed,
    Cancel,
    Commit,
    CreateNode,
    DeleteBlocks,
    LogEvent,
    ManifestDone,
    ManifestFailed,
    NodeFailed,
    NodeReady,
    Reply,
    Retire,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    WriteManifest,
    WriteReport,
)
from ..protocol.node_state import NOT_MEMBER
from ..protocol.policy import PLUGIN_NAME, ROLE, TOPIC, plan_placement
from ..protocol.replies import BeatReply, ReportReply
from .node_keeper import NodeKeeper
from .rpc import call_actor
from .stimuli import stimulus, validating

logger = logging.getLogger(__name__)

__all__ = ["ShardPlacement"]


class ShardPlacement(SchedulerPlugin):
    """The PS controller (see the module doc). One instance serves every parameter server."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, role: str = ROLE):
        self.role = role
        self.servers: dict[str, ServerState] = {}
        self.info: dict[str, dict] = {}
        self.scheduler: Any = None
        self._keeper: NodeKeeper | None = None  # node actors and workers
        # a plain counter: a client pickles the plugin to register it, and Python 3.12 warns
        # on pickling an itertools.count (3.14 refuses)
        self._next_req = 0
        self._validate = validating()  # adam.ps.validate: check the invariants each event
        self._futures: dict[int, asyncio.Future] = {}
        self._calls: dict[tuple[str, int], asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._ticker: asyncio.Task | None = None
        self._creating: set[str] = set()  # servers whose nodes exist but not their state yet

    # -- plugin hooks ----------------------------------------------------------------------------

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._keeper = NodeKeeper(scheduler)
        install()  # the scheduler's log records are redacted
        scheduler.handlers.update(
            {
                "adam_ps_create": self.create_server,
                "adam_ps_routing": self.routing,
                "adam_ps_close": self.close_server,
                "adam_ps_servers": self.list_servers,
                "adam_ps_heartbeat": self.heartbeat,
                "adam_ps_written": self.written,
                "adam_ps_commit": self.commit,
                "adam_ps_story": self.story,
            }
        )
        self._ticker = asyncio.ensure_future(self._tick_loop())

    async def before_close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._keeper is not None:
            await self._keeper.close()

    def remove_worker(
        self, scheduler: Any, worker: str, *, stimulus_id: str | None = None, **kwargs: Any
    ) -> None:
        now = time.monotonic()
        cause = stimulus_id or stimulus("remove-worker")  # Dask's, when it gives one
        for sid in list(self.servers):
            self._feed(sid, WorkerRemoved(worker, now, stimulus_id=cause))

    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is None or not ws.resources.get(self.role):
            return
        now = time.monotonic()
        cause = stimulus("add-worker")  # Dask hands this hook none
        for sid in list(self.servers):
            self._feed(sid, WorkerAdded(worker, ws.host, now, stimulus_id=cause))

    def valid_workers_downscaling(self, scheduler: Any, workers: list) -> list:
        busy = {a for st in self.servers.values() for hs in st.routing.values() for a in hs}
        keep = [ws for ws in workers if ws.address not in busy]
        if len(keep) < len(workers):
            logger.info(
                "not down-scaling %d PS worker(s) that hold shards", len(workers) - len(keep)
            )
        return keep

    # -- carrying out the controller's actions ---------------------------------------------------

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _feed(self, server_id: str, event: Any) -> None:
        state = self.servers.get(server_id)
        if state is not None:
            self._do(server_id, handle(state, event, validate=self._validate))

    def _do(self, server_id: str, actions: list) -> None:
        for a in actions:
            if isinstance(a, Reply):
                fut = self._futures.pop(a.req, None)
                if fut is not None and not fut.done():
                    fut.set_result(a.value)
            elif isinstance(a, Call):
                self._calls[(server_id, a.op)] = self._spawn(self._call(server_id, a))
            elif isinstance(a, Cancel):
                task = self._calls.pop((server_id, a.op or -1), None)
                if task is not None:
                    task.cancel()
            elif isinstance(a, CreateNode):
                self._spawn(self._create_node(server_id, a))
            elif isinstance(a, Retire):
                self._spawn(self.keeper.retire(a.addr))
            elif isinstance(a, WriteManifest):
                self._spawn(self._write_manifest(server_id, a))
            elif isinstance(a, DeleteBlocks):
                self._spawn(self._delete_blocks(server_id, a.paths))
            elif isinstance(a, LogEvent):
                self.scheduler.log_event(TOPIC, a.msg)
            else:  # pragma: no cover - every controller action is handled above
                raise TypeError(f"unknown controller action {a!r}")

    async def _ask(self, server_id: str, make: Any, stimulus_id: str) -> Any:
        req = self._next_req
        self._next_req += 1
        fut = asyncio.get_running_loop().create_future()
        self._futures[req] = fut
        self._feed(server_id, replace(make(req), stimulus_id=stimulus_id))
        try:
            return await fut
        finally:
            self._futures.pop(req, None)

    async def _tick_loop(self) -> None:
        interval = float(config.get("ps.heartbeat-interval")) / 2
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            cause = stimulus("tick")
            for sid in list(self.servers):
                try:
                    self._feed(sid, Tick(now, stimulus_id=cause))
                except Exception:  # pragma: no cover - the controller must keep ticking
                    logger.exception("PS controller tick of %s failed", sid)

    @property
    def keeper(self) -> NodeKeeper:
        assert self._keeper is not None, "the plugin has not started"
        return self._keeper

    @property
    def _timeout(self) -> float:
        return float(config.get("ps.call-timeout"))

    async def _call(self, server_id: str, a: Call) -> None:
        try:
            result = await call_actor(
                self.scheduler.rpc,
                a.addr,
                a.key,
                a.method,
                *a.args,
                timeout=self._timeout,
                stimulus_id=a.stimulus_id,  # the node's story names the controller's cause
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._calls.pop((server_id, a.op), None)
            why = f"{type(exc).__name__}: {exc}"
            self._feed(server_id, CallFailed(a.op, why, stimulus_id=a.stimulus_id))
            return
        self._calls.pop((server_id, a.op), None)
        self._feed(server_id, CallDone(a.op, result, stimulus_id=a.stimulus_id))

    async def _create_node(self, server_id: str, a: CreateNode) -> None:
        addr = a.addr
        try:
            key = await self.keeper.new_node(server_id, addr, self.info[server_id]["node_config"])
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            self._feed(server_id, NodeFailed(addr, why, stimulus_id=a.stimulus_id))
            return
        self._feed(server_id, NodeReady(addr, key, time.monotonic(), stimulus_id=a.stimulus_id))

    async def _write_manifest(self, server_id: str, a: WriteManifest) -> None:
        from ..checkpoint import put_manifest

        info = self.info.get(server_id)
        if info is None:
            return
        try:
            await asyncio.to_thread(
                put_manifest, info["checkpoint"], info["storage_options"], a.doc
            )
        except Exception as exc:
            why = process_redactor()(f"{type(exc).__name__}: {exc}")
            self._feed(
                server_id, ManifestFailed(a.seq, why, time.monotonic(), stimulus_id=a.stimulus_id)
            )
            return
        self._feed(server_id, ManifestDone(a.seq, stimulus_id=a.stimulus_id))

    async def _delete_blocks(self, server_id: str, paths: tuple[str, ...]) -> None:
        from ..checkpoint import BlockStore

        info = self.info.get(server_id)
        if info is None or not paths:
            return
        store = BlockStore(info["checkpoint"], info["storage_options"])
        try:
            await asyncio.to_thread(store.delete, list(paths))
        except Exception as exc:
            logger.info("server %s: deleting old blocks failed (%s)", server_id, exc)

    async def _sweep(self, server_id: str, named: set[str]) -> None:
        from ..checkpoint import BlockStore

        info = self.info[server_id]
        store = BlockStore(info["checkpoint"], info["storage_options"])
        try:
            orphans = await asyncio.to_thread(store.orphans, named)
            if orphans:
                logger.info("server %s: removing %d unnamed blocks", server_id, len(orphans))
                await asyncio.to_thread(store.delete, orphans)
        except Exception as exc:
            logger.info("server %s: sweeping unnamed blocks failed (%s)", server_id, exc)

    # -- scheduler handlers ----------------------------------------------------------------------

    def _ps_workers(self) -> dict[str, str]:
        """{addr: host} of the running PS workers."""
        return {ws.address: ws.host for ws in self.scheduler.running if ws.resources.get(self.role)}

    async def create_server(
        self,
        server_id: str,
        shards: list,
        copies: int,
        node_config: dict,
        info: dict | None = None,
        manifest: dict | None = None,
        generation: int = 0,
    ) -> dict:
        """Place and make the nodes of a new server; returns its routing, or ``{"refused":
        why}`` when this scheduler can not reach the checkpoint (it writes the manifest): such
        a server could never checkpoint, so it is not made."""
        if server_id in self.servers:
            raise ValueError(f"a parameter server {server_id!r} exists already")
        remember((info or {}).get("storage_options"))
        checkpoint = (info or {}).get("checkpoint")
        if checkpoint is not None and manifest is not None:
            why = await self._unreachable(checkpoint, (info or {}).get("storage_options"), manifest)
            if why is not None:
                logger.warning(
                    "server %s refused: the scheduler can not reach the checkpoint at %s (%s)",
                    server_id,
                    redact_url(str(checkpoint)),
                    why,
                )
                return {"refused": process_redactor()(why)}
        live = self._ps_workers()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = plan_placement(len(shards), live, int(copies))
        for w in caught:
            logger.warning("server %s: %s", server_id, w.message)
        shards = [tuple(s) for s in shards]
        self.info[server_id] = {**(info or {}), "node_config": dict(node_config)}
        self._creating.add(server_id)
        addrs = sorted({a for h in plan.values() for a in h})
        nodes: dict[str, str] = {}
        try:
            keys = await asyncio.gather(
                *(self.keeper.new_node(server_id, a, node_config) for a in addrs)
            )
            nodes = dict(zip(addrs, keys))
            gens = dict.fromkeys(range(len(shards)), int(generation))
            await asyncio.gather(
                *(
                    call_actor(
                        self.scheduler.rpc,
                        a,
                        nodes[a],
                        "assign",
                        {s: shards[s] for s, h in plan.items() if a in h},
                        {s: gens[s] for s, h in plan.items() if a in h},
                        {s: [(b, nodes[b]) for b in h[1:]] for s, h in plan.items() if h[0] == a},
                        timeout=self._timeout,
                    )
                    for a in addrs
                )
            )
        except BaseException:
            self._creating.discard(server_id)
            await self.keeper.release(server_id, nodes)
            self.info.pop(server_id, None)
            raise
        self._creating.discard(server_id)
        self.servers[server_id] = ServerState(
            server_id,
            shards,
            target=min(int(copies), len(live)),
            routing=plan,
            nodes=nodes,
            workers=live,
            gens=gens,
            generation=int(generation),
            manifest=manifest,
            now=time.monotonic(),
            heartbeat_timeout=float(config.get("ps.heartbeat-timeout")),
            retire_timeout=float(config.get("ps.retire-timeout")),
            block_grace=float(config.get("ps.block-grace")),
            retry_base=float(config.get("ps.retry-base")),
            retry_max=float(config.get("ps.retry-max")),
        )
        if manifest is not None:
            self._spawn(self._sweep(server_id, set(manifest["blocks"])))
        logger.info(
            "server %s: %d shards x %d copies on %d PS workers",
            server_id,
            len(shards),
            copies,
            len(addrs),
        )
        return self.routing(server_id)

    async def _unreachable(self, url: str, storage_options: dict | None, doc: dict) -> str | None:
        """Why this scheduler can not read and write the manifest at ``url`` (None: it can),
        within ``adam.ps.call-timeout``."""
        from ..checkpoint import manifest_unreachable

        try:
            return await asyncio.wait_for(
                asyncio.to_thread(manifest_unreachable, url, storage_options, doc), self._timeout
            )
        except TimeoutError:
            return f"no answer from its storage in {self._timeout:g}s"

    def routing(self, server_id: str) -> dict:
        """The routing of a server (see ``ParameterServer.routing_info``), and ``info``: every
        pusher asks for it, so it carries no storage options (the nodes got theirs once, when
        made) and URLs without credentials."""
        state = self.servers.get(server_id)
        if state is None:
            raise KeyError(f"no parameter server {server_id!r} on this scheduler")
        info = {
            k: v
            for k, v in self.info[server_id].items()
            if k not in ("node_config", "storage_options")
        }
        return {**state.routing_info(), "info": redact_urls(info)}

    def story(self, server_id: str, sid: int | None = None) -> list[dict]:
        """The controller's story of shard ``sid`` of a server (every shard: ``None``)."""
        state = self.servers.get(server_id)
        if state is None:
            raise KeyError(f"no parameter server {server_id!r} on this scheduler")
        return [e.to_dict() for e in state.story(sid)]

    def storage(self, server_id: str) -> tuple[str | None, dict | None]:
        """``(checkpoint URL, storage options)`` of a server, for the scheduler's own readers
        (the dashboard reads the run's history with them); never sent to anyone."""
        info = self.info.get(server_id) or {}
        return info.get("checkpoint"), info.get("storage_options")

    def list_servers(self) -> list[str]:
        return sorted(self.servers)

    async def heartbeat(self, server_id: str, addr: str, key: str, positions: dict) -> dict:
        if server_id in self._creating:
            return BeatReply(True, {}).to_wire()
        if server_id not in self.servers:
            return BeatReply(False, {}).to_wire()
        pos = {int(s): (int(p[0]), int(p[1])) for s, p in positions.items()}
        reply: BeatReply = await self._ask(
            server_id, lambda r: Beat(r, addr, key, time.monotonic(), pos), stimulus("heartbeat")
        )
        return reply.to_wire()

    async def written(self, server_id: str, addr: str, blocks: dict) -> dict:
        if server_id not in self.servers:
            return ReportReply({}, {int(s): NOT_MEMBER for s in blocks}).to_wire()
        b = {int(s): (int(g), int(v), str(p)) for s, (g, v, p) in blocks.items()}
        reply: ReportReply = await self._ask(
            server_id, lambda r: WriteReport(r, addr, b), stimulus("written")
        )
        return reply.to_wire()

    async def commit(self, server_id: str, epoch: Any = None, meta: dict | None = None) -> dict:
        """Store ``epoch``/``meta`` in the manifest; returns the manifest once written."""
        return await self._ask(server_id, lambda r: Commit(r, epoch, meta), stimulus("commit"))

    async def close_server(self, server_id: str) -> None:
        """Stop and release the nodes of a server."""
        state = self.servers.pop(server_id, None)
        if state is None:
            return
        for key in [k for k in self._calls if k[0] == server_id]:
            self._calls.pop(key).cancel()
        await self.keeper.release(server_id, state.nodes)
        self.info.pop(server_id, None)
        logger.info("server %s closed", server_id)
