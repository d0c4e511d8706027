"""The Adam page on the Dask dashboard: ``/adam`` (HTML) and ``/adam/status.json``.

It shows which PS worker holds which shard (shards x copies, primaries and backups), the
update rate, replication and write-back lag of every PS node, the fail-over events, and the
training curves (images/s from the replicas' progress, loss and test accuracy from the run's
checkpoint history).

Serving it: the page is a :class:`AdamDashboard` scheduler plugin. Register it from a client
(``register`` returns the page's URL)::

    url = adam_dask.dashboard.register(client)

or preload it on a scheduler you start yourself (``dask scheduler --preload
adam_dask.ps.placement --preload adam_dask.dashboard``; the dask-gateway values and the Dask
operator manifests in ``deploy/`` do). In a notebook, :func:`snapshot` shows the same tables.

Why Tornado handlers and not a Bokeh app: a plugin can add Tornado routes to a running
scheduler's HTTP application at any time (``distributed.scheduler.http.routes`` and the Bokeh
apps of ``distributed.dashboard`` are fixed when the scheduler is built), the page then works
without bokeh and without websockets (through a gateway's proxy), and the HTML and the JSON are
rendered from one status dict, which tests read over plain HTTP and in headless Chromium.
"""

from __future__ import annotations

from typing import Any

from .. import config
from ._html import render_page, render_tables, svg_chart
from ._plugin import PLUGIN_NAME, STATUS_HANDLER, AdamDashboard
from ._status import RateMeter, build_status, training_runs

__all__ = [
    "PLUGIN_NAME",
    "AdamDashboard",
    "RateMeter",
    "Snapshot",
    "build_status",
    "dask_setup",
    "register",
    "render_page",
    "render_tables",
    "snapshot",
    "status",
    "svg_chart",
    "training_runs",
    "url",
]


def dask_setup(scheduler: Any) -> None:
    """Scheduler preload hook: ``dask scheduler --preload adam_dask.dashboard``."""
    scheduler.add_plugin(AdamDashboard(), idempotent=True)


def url(client: Any) -> str | None:
    """The Adam page's URL beside the client's dashboard link (None without a dashboard)."""
    try:
        link = client.dashboard_link
    except Exception:
        return None
    if not link:
        return None
    base = link[: -len("/status")] if link.endswith("/status") else link.rstrip("/")
    return base + "/adam"


def register(client: Any) -> str | None:
    """Serve the Adam page on ``client``'s scheduler (once; later calls do nothing) and return
    its URL."""
    client.register_plugin(AdamDashboard())
    return url(client)


def status(client: Any) -> dict:
    """The page's status dict, fetched from the scheduler (the plugin must be registered)."""
    return client.sync(getattr(client.scheduler, STATUS_HANDLER))


class Snapshot:
    """A status dict that Jupyter displays as the page's tables."""

    def __init__(self, status: dict):
        self.status = status

    def __repr__(self) -> str:
        servers = self.status.get("servers") or []
        return f"Snapshot({len(self.status.get('workers') or [])} workers, {len(servers)} servers)"

    def _repr_html_(self) -> str:
        return render_tables(
            self.status, max_columns=int(config.get("dashboard.max-shard-columns"))
        )


def snapshot(client: Any) -> Snapshot:
    """The Adam page's tables, now, for a notebook (registers the page if needed)."""
    client.register_plugin(AdamDashboard())
    return Snapshot(status(client))
