"""The scheduler side of the Adam page: a SchedulerPlugin that serves ``/adam``.

:class:`AdamDashboard` adds two Tornado handlers to the scheduler's HTTP application when it
starts (``/adam``, ``/adam/status.json``, under any dashboard prefix) and a scheduler handler
``adam_dashboard_status`` for clients. On each request it gathers, on the scheduler's event
loop, what the page shows: the PS controller's servers and routing through its scheduler
handlers (``adam_ps_servers``, ``adam_ps_routing``), each PS node's ``stats()`` through the
actor protocol (with a short timeout: a frozen node shows as unreachable, the page still
answers), the replicas' progress and the controller's fail-over events from the scheduler's
event log, and each run's per-epoch history from its checkpoint (read in a thread, cached for
``refresh`` seconds). :func:`~adam_dask.dashboard._status.build_status` turns them into the
status dict.

Nothing the page shows holds a credential: the routing carries no storage options (the
history is read with the ones the controller keeps, taken from the plugin in this process), URLs
are shown without user information or signed query values, and every string of the status is
passed through the scheduler's redactor (:mod:`adam_dask._secrets`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from .. import config
from .._secrets import install, scrub
from ..ps.protocol.policy import PLUGIN_NAME as PS_PLUGIN_NAME
from ._html import render_page
from ._status import PROGRESS_TOPIC, PS_TOPIC, RateMeter, build_status

__all__ = ["PLUGIN_NAME", "STATUS_HANDLER", "AdamDashboard"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "adam-dashboard"
STATUS_HANDLER = "adam_dashboard_status"
# routes under any prefix (a gateway serves the dashboard at /clusters/<name>/)
_PAGE_ROUTE = r"(?:/.*)?/adam/?"
_JSON_ROUTE = r"(?:/.*)?/adam/status\.json"


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


class _PageHandler(web.RequestHandler):
    def initialize(self, dashboard: AdamDashboard) -> None:
        self.dashboard = dashboard

    async def get(self) -> None:
        if self.request.path.endswith("/"):  # keep the page's relative links right
            self.redirect(self.request.path.rstrip("/"))
            return
        status = await self.dashboard.collect()
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.write(
            render_page(
                status, self.dashboard.refresh, max_columns=self.dashboard.max_shard_columns
            )
        )


class _StatusHandler(web.RequestHandler):
    def initialize(self, dashboard: AdamDashboard) -> None:
        self.dashboard = dashboard

    async def get(self) -> None:
        status = await self.dashboard.collect()
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(status, allow_nan=False, default=str))


class AdamDashboard(SchedulerPlugin):
    """Serves the Adam page on the scheduler's dashboard (see the module doc).

    Parameters default to the ``adam.dashboard`` configuration: ``refresh`` (seconds between
    page updates and checkpoint-history reads), ``rate_window`` (seconds behind the update
    rates), ``call_timeout`` (seconds to wait for a PS node), ``events`` (PS events listed),
    ``max_shard_columns`` (widest shard table).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(
        self,
        *,
        refresh: float | None = None,
        rate_window: float | None = None,
        call_timeout: float | None = None,
        events: int | None = None,
        max_shard_columns: int | None = None,
    ):
        self.refresh = float(config.get("dashboard.refresh", refresh))
        self.rate_window = float(config.get("dashboard.rate-window", rate_window))
        self.call_timeout = float(config.get("dashboard.call-timeout", call_timeout))
        self.events = int(config.get("dashboard.events", events))
        self.max_shard_columns = int(config.get("dashboard.max-shard-columns", max_shard_columns))
        self.scheduler: Any = None
        self._meter = RateMeter(self.rate_window)
        self._histories: dict[str, tuple[float, list[dict] | None]] = {}

    # -- plugin hooks ----------------------------------------------------------------------------

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        install()  # the scheduler's log records are redacted
        scheduler.handlers[STATUS_HANDLER] = self.collect
        app = getattr(scheduler, "http_application", None)
        if app is None:  # pragma: no cover - every distributed Scheduler has one
            logger.warning("the scheduler serves no HTTP: the Adam page is not available")
            return
        app.add_handlers(
            r".*$",
            [
                (_JSON_ROUTE, _StatusHandler, {"dashboard": self}),
                (_PAGE_ROUTE, _PageHandler, {"dashboard": self}),
            ],
        )
        logger.info("the Adam page is served at /adam on the scheduler's dashboard")

    # -- gathering -------------------------------------------------------------------------------

    async def collect(self) -> dict:
        """The status dict (see :func:`~adam_dask.dashboard._status.build_status`), every
        string redacted."""
        s = self.scheduler
        workers = {
            a: {"name": ws.name, "host": ws.host, "resources": dict(ws.resources)}
            for a, ws in s.workers.items()
        }
        servers = await self._servers()
        calls = [
            (sid, addr, key)
            for sid, r in servers.items()
            for addr, key in (r.get("nodes") or {}).items()
        ]
        results = await asyncio.gather(
            *(self._node_stats(addr, key) for _, addr, key in calls), return_exceptions=True
        )
        now = time.monotonic()
        node_stats: dict[str, dict[str, Any]] = {sid: {} for sid in servers}
        rates: dict[str, dict[str, float | None]] = {sid: {} for sid in servers}
        for (sid, addr, _), res in zip(calls, results):
            if isinstance(res, BaseException):
                node_stats[sid][addr] = f"unreachable ({type(res).__name__})"
                continue
            node_stats[sid][addr] = res
            pushes = res.get("pushes") if isinstance(res, dict) else None
            if isinstance(pushes, (int, float)):
                rates[sid][addr] = self._meter.add((sid, addr), now, pushes)
        self._meter.forget((sid, addr) for sid, addr, _ in calls)
        status = build_status(
            now=time.time(),
            workers=workers,
            servers=servers,
            node_stats=node_stats,
            rates=rates,
            progress=s.get_events(PROGRESS_TOPIC),
            ps_events=s.get_events(PS_TOPIC),
            histories=await self._run_histories(servers),
            max_events=self.events,
            stories=await self._stories(servers),
        )
        return scrub(status)

    async def _servers(self) -> dict[str, dict]:
        """{server id: routing} from the PS controller's scheduler handlers (none when no
        parameter server was ever created here)."""
        handlers = self.scheduler.handlers
        list_servers, routing = handlers.get("adam_ps_servers"), handlers.get("adam_ps_routing")
        if list_servers is None or routing is None:
            return {}
        out = {}
        for sid in await _maybe_await(list_servers()):
            try:
                out[sid] = await _maybe_await(routing(server_id=sid))
            except KeyError:  # closed meanwhile
                continue
        return out

    async def _stories(self, servers: Mapping[str, Any]) -> dict[str, list]:
        """{server id: the controller's story} (``adam_ps_story``; none without it)."""
        story = self.scheduler.handlers.get("adam_ps_story")
        out: dict[str, list] = {}
        if story is None:
            return out
        for sid in servers:
            try:
                out[sid] = list(await _maybe_await(story(server_id=sid)))
            except KeyError:  # closed meanwhile
                continue
        return out

    async def _node_stats(self, addr: str, key: str) -> dict:
        """``stats()`` of the PS node actor ``key`` on the worker ``addr``."""
        from distributed.protocol.serialize import Serialized, deserialize

        resp = await asyncio.wait_for(
            self.scheduler.rpc(addr).actor_execute(actor=key, function="stats", args=[], kwargs={}),
            self.call_timeout,
        )
        if resp.get("status") != "OK":
            raise RuntimeError(f"stats() failed on {addr}")
        result = resp["result"]
        if isinstance(result, Serialized):  # the scheduler's pool does not deserialize
            result = deserialize(result.header, result.frames)
        return result

    async def _run_histories(self, servers: dict[str, dict]) -> dict[str, list[dict] | None]:
        """{run id: per-epoch records} read from the runs' checkpoints (``history.jsonl``)."""
        out: dict[str, list[dict] | None] = {}
        placement = self.scheduler.plugins.get(PS_PLUGIN_NAME)
        for sid, r in servers.items():
            info = r.get("info") or {}
            run = (info.get("meta") or {}).get("run")
            url, options = placement.storage(sid) if placement is not None else (None, None)
            if run and url:
                out[run] = await self._history(url, options)
        return out

    async def _history(self, checkpoint: str, storage_options: dict | None) -> list[dict] | None:
        t, records = self._histories.get(checkpoint, (-float("inf"), None))
        if time.monotonic() - t < self.refresh:
            return records
        try:
            records = await asyncio.to_thread(_read_history, checkpoint, storage_options)
        except FileNotFoundError:
            records = None  # no epoch finished yet
        except Exception as exc:  # the page shows what it can
            logger.debug("cannot read the history of %s: %s", checkpoint, exc)
            records = None
        self._histories[checkpoint] = (time.monotonic(), records)
        return records


def _read_history(checkpoint: str, storage_options: dict | None) -> list[dict]:
    """The JSON lines of ``<checkpoint>/history.jsonl`` (the Trainer writes it every epoch)."""
    from ..storage import filesystem, normalize_url

    fs, path = filesystem(normalize_url(checkpoint) + "/history.jsonl", storage_options)
    text = fs.cat_file(path).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
