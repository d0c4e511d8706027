"""The Adam page as HTML: tables and small SVG charts rendered from the status dict.

Pure functions of :func:`~adam_dask.dashboard._status.build_status`'s dict; no Dask. The page
is complete as served (no JavaScript is needed to see it, so ``chromium --dump-dom`` and
screenshots show the tables); a few lines of script refetch it every ``refresh`` seconds and
swap the content in place.

>>> page = render_page({"time": 0, "workers": [], "servers": [], "training": [], "events": []}, 2)
>>> "No parameter server" in page
True
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

__all__ = ["render_page", "render_tables", "svg_chart"]

_STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1f2933;
background:#f5f7fa}
header{background:#1f2933;color:#fff;padding:10px 20px;display:flex;gap:20px;align-items:baseline}
header h1{font-size:18px;margin:0}header a{color:#9fd3ff}.updated{margin:0 0 8px}
main{padding:12px 20px}section{background:#fff;border-radius:6px;padding:10px 14px;margin:0 0 14px;
box-shadow:0 1px 2px rgba(0,0,0,.08)}h2{font-size:16px;margin:4px 0 8px}h3{font-size:14px;margin:10px 0 6px}
table{border-collapse:collapse;margin:4px 0 8px}th,td{padding:3px 8px;border-bottom:1px solid #e4e7eb;
text-align:left;white-space:nowrap}.ps-nodes td:nth-child(n+3),.epochs td{text-align:right}
thead th{background:#f0f4f8;font-weight:600}
.shard-table td{text-align:center;min-width:22px;padding:3px 4px;font-weight:600}
td.primary{background:#2f80ed;color:#fff}td.backup{background:#c9e2ff;color:#1f2933}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;font-weight:600}
.ok{background:#d3f9d8;color:#2b8a3e}.warn{background:#fff3bf;color:#8a6d00}.bad{background:#ffe3e3;color:#c92a2a}
.kpis{display:flex;gap:10px;flex-wrap:wrap;margin:6px 0}.kpi{background:#f0f4f8;border-radius:6px;
padding:6px 12px;min-width:120px}.kpi b{display:block;font-size:18px}.kpi span{font-size:12px;opacity:.75}
.charts{display:flex;gap:12px;flex-wrap:wrap}.muted{opacity:.6}.err{color:#c92a2a}
"""

_SCRIPT = """
(function(){const ms=%d;if(!ms)return;setInterval(async()=>{try{
const r=await fetch(location.href,{cache:"no-store"});if(!r.ok)return;
const d=new DOMParser().parseFromString(await r.text(),"text/html");
const n=d.getElementById("adam");if(n)document.getElementById("adam").replaceWith(n);
}catch(e){}},ms);})();
"""


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if abs(x) >= 100:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    if isinstance(x, int):
        return f"{x:,}"
    return escape(str(x))


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


Cell = str | tuple[str, str]  # pre-escaped HTML, or (HTML, CSS class)


def _table(
    head: Sequence[str], rows: Iterable[Sequence[Cell]], attrs: str = "", header_col: bool = False
) -> str:
    """A table from pre-escaped cell HTML; the first column as row headers with ``header_col``."""
    out = [f"<table {attrs}><thead><tr>"]
    out += [f"<th>{h}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            html, cls = cell if isinstance(cell, tuple) else (cell, "")
            tag = "th" if header_col and i == 0 else "td"
            out.append(f'<{tag} class="{cls}">{html}</{tag}>' if cls else f"<{tag}>{html}</{tag}>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def svg_chart(
    points: Sequence[tuple[float, float | None]],
    *,
    title: str,
    color: str = "#2f80ed",
    percent: bool = False,
    width: int = 300,
    height: int = 150,
) -> str:
    """A small line chart of ``points`` (x, y); y None is skipped. Returns an ``<svg>``."""
    pts = [(float(x), float(y)) for x, y in points if y is not None]
    left, right, top, bottom = 46, 10, 22, 24
    w, h = width - left - right, height - top - bottom
    parts = [
        f'<svg class="chart" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{left}" y="14" font-size="12" font-weight="600">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#f8fafc" stroke="#e4e7eb"/>',
    ]
    if pts:
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        x0, x1 = min(xs), max(xs)
        y0, y1 = min(ys), max(ys)
        if y1 - y0 < 1e-12:
            y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)

        def sx(x: float) -> float:
            return left + (w * (x - x0) / (x1 - x0) if x1 > x0 else w / 2)

        def sy(y: float) -> float:
            return top + h - h * (y - y0) / (y1 - y0)

        def label(y: float) -> str:
            return f"{100 * y:.1f}%" if percent else _fmt(float(y))

        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        parts += [
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in pts
        ]
        parts += [
            f'<text x="{left - 4}" y="{top + 9}" font-size="10" text-anchor="end">{label(y1)}</text>',
            f'<text x="{left - 4}" y="{top + h}" font-size="10" text-anchor="end">{label(y0)}</text>',
            f'<text x="{left}" y="{height - 8}" font-size="10">epoch {x0:g}</text>',
            f'<text x="{left + w}" y="{height - 8}" font-size="10" text-anchor="end">{x1:g}</text>',
        ]
    else:
        parts.append(
            f'<text x="{left + w / 2}" y="{top + h / 2}" font-size="11" text-anchor="middle" '
            'fill="#888">no data yet</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _plan_html(plan: Mapping[str, Any]) -> str:
    """A partitioned replica's plan: each partition's layers, parameters and memory."""
    parts = plan.get("partitions") or []
    out = [
        f"<p>each model replica spans {len(parts)} TRAIN workers "
        f"({_fmt(plan.get('cross_bytes_per_image'))} bytes per image between them):</p>",
        '<table class="partition-plan"><tr><th>partition</th><th>layers</th>'
        "<th>parameters</th><th>memory (MiB)</th></tr>",
    ]
    for p in parts:
        if not isinstance(p, Mapping):
            continue
        layers = p.get("layers") or [0, 0]
        toks = ",".join(str(t) for t in p.get("tokens") or [])
        mem = p.get("memory")
        out.append(
            f"<tr><td>{escape(str(p.get('index')))}</td>"
            f"<td>{escape(str(layers[0]))}-{escape(str(int(layers[1]) - 1))} "
            f"<code>{escape(toks)}</code></td>"
            f"<td>{_fmt(p.get('params'))}</td>"
            f"<td>{_fmt(round(mem / 2**20)) if isinstance(mem, int | float) else '–'}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)


def _server_html(srv: Mapping[str, Any], max_columns: int) -> str:
    sid = escape(str(srv["id"]))
    if srv.get("lost"):
        badge = '<span class="badge bad">shards lost</span>'
    elif srv.get("healthy"):
        badge = '<span class="badge ok">healthy</span>'
    else:
        badge = '<span class="badge warn">repairing</span>'
    heals = srv.get("heal_times") or []
    tot = srv.get("totals") or {}
    out = [
        f'<section class="server" id="server-{sid}" data-server="{sid}">',
        f"<h2>Parameter server <code>{sid}</code>: {srv['shards']} shards &times; "
        f"{_fmt(srv.get('copies'))} copies {badge}</h2>",
        '<div class="kpis">',
        f'<div class="kpi"><b>{_fmt(tot.get("pushes_per_second"))}</b><span>shard updates / s</span></div>',
        f'<div class="kpi"><b>{_fmt(tot.get("max_replication_lag"))}</b><span>replication lag (versions)</span></div>',
        f'<div class="kpi"><b>{_fmt(tot.get("writeback_lag_versions"))}</b><span>write-back lag (versions)</span></div>',
        f'<div class="kpi"><b>{_fmt(tot.get("writeback_lag_seconds"))}</b><span>write-back lag (s)</span></div>',
        f'<div class="kpi"><b>{_fmt(srv.get("generation"))}</b><span>routing generation</span></div>',
        f'<div class="kpi" data-kpi="optimizer"><b>{escape(str(srv.get("optimizer") or "sum"))}</b>'
        "<span>server optimizer</span></div>",
        f'<div class="kpi"><b>{_fmt(heals[-1]) if heals else "–"}</b>'
        f"<span>last fail-over (s), {len(heals)} in all</span></div>",
        "</div>",
    ]
    if srv.get("pending"):
        out.append(f"<p>waiting for a new primary: shards {escape(str(srv['pending']))}</p>")
    if srv.get("lost"):
        out.append(f'<p class="err">every copy lost: shards {escape(str(srv["lost"]))}</p>')
    if srv.get("checkpoint"):
        out.append(f"<p>checkpoint: <code>{escape(str(srv['checkpoint']))}</code></p>")
    plan = srv.get("partition_plan")
    if isinstance(plan, Mapping) and plan.get("partitions"):
        out.append(_plan_html(plan))
    nodes = srv.get("nodes") or []
    rows: list[list[Cell]] = []
    for n in nodes:
        addr = escape(str(n["address"]))
        err = f' <span class="err">{escape(str(n["error"]))}</span>' if n.get("error") else ""
        rows.append(
            [
                f"<code>{addr}</code>{err}",
                _fmt(n.get("name")),
                _fmt(len(n.get("primaries") or [])),
                _fmt(len(n.get("backups") or [])),
                _fmt(n.get("copies")),
                _fmt(n.get("pushes_per_second")),
                _fmt(n.get("replication_lag")),
                _fmt(n.get("writeback_lag_versions")),
                _fmt(n.get("writeback_lag_seconds")),
                _fmt(n.get("writeback_errors")),
            ]
        )
    out.append("<h3>PS workers</h3>")
    out.append(
        _table(
            [
                "worker",
                "name",
                "primaries",
                "backups",
                "copies",
                "updates/s",
                "repl. lag",
                "write-back lag",
                "write-back lag (s)",
                "write errors",
            ],
            rows,
            f'class="ps-nodes" data-server="{sid}"',
        )
    )
    n_shards = int(srv.get("shards") or 0)
    placement = srv.get("placement") or {}
    versions = srv.get("shard_versions") or {}
    if n_shards <= max_columns:
        rows = []  # the shard table
        for n in nodes:
            addr = n["address"]
            cells: list[Cell] = [f"<code>{escape(str(addr))}</code>"]
            for s in range(n_shards):
                holders = placement.get(str(s)) or []
                v = (versions.get(str(s)) or {}).get(addr)
                title = f' title="shard {s}, version {v}"' if v is not None else ""
                if holders and holders[0] == addr:
                    cells.append((f"<span{title}>P</span>", "primary"))
                elif addr in holders:
                    cells.append((f"<span{title}>B</span>", "backup"))
                else:
                    cells.append("")
            rows.append(cells)
        table = _table(
            ["worker \\ shard", *(str(s) for s in range(n_shards))],
            rows,
            f'class="shard-table" data-server="{sid}"',
            header_col=True,
        )
        out.append("<h3>Shards &times; copies (P primary, B backup)</h3>" + table)
    else:
        out.append(
            f'<p class="muted">{n_shards} shards: the shard table shows at most {max_columns} '
            "columns (adam.dashboard.max-shard-columns); see the counts above.</p>"
        )
    story = srv.get("story") or []
    if story:  # why the shards are where they are: the controller's events of note, newest first
        rows = [
            [
                f"<code>{escape(str(e.get('stimulus', '')))}</code>",
                escape(str(e.get("event", ""))),
                escape(", ".join(str(x) for x in e.get("shards") or []) or "all"),
                escape("; ".join(str(a) for a in e.get("actions") or [])),
            ]
            for e in story
        ]
        out.append(
            "<h3>Story: the controller's events of note, newest first</h3>"
            + _table(
                ["stimulus", "event", "shards", "actions"],
                rows,
                f'class="ps-story" data-server="{sid}"',
            )
        )
    out.append("</section>")
    return "".join(out)


def _training_html(runs: Sequence[Mapping[str, Any]]) -> str:
    out = ['<section id="training"><h2>Training</h2>']
    if not runs:
        out.append('<p class="muted">No training progress reported yet.</p>')
    for run in runs[::-1]:  # newest first
        epochs = run.get("epochs") or []
        rid = escape(str(run.get("run")))
        out.append(f"<h3>Run <code>{rid}</code></h3>")
        x = [e["epoch"] + 1 for e in epochs]
        out.append('<div class="charts">')
        out.append(
            svg_chart(
                list(zip(x, [e.get("test_accuracy") for e in epochs])),
                title="test accuracy",
                color="#2b8a3e",
                percent=True,
            )
        )
        out.append(svg_chart(list(zip(x, [e.get("loss") for e in epochs])), title="training loss"))
        out.append(
            svg_chart(
                list(zip(x, [e.get("images_per_second") for e in epochs])),
                title="images / s",
                color="#e8590c",
            )
        )
        out.append("</div>")
        rows = [
            [
                _fmt(e["epoch"] + 1),
                _fmt(e.get("images")),
                _fmt(e.get("seconds")),
                _fmt(e.get("images_per_second")),
                _fmt(e.get("loss"), 4),
                _pct(e.get("test_accuracy")),
                "done" if e.get("finished") else "running",
            ]
            for e in epochs
        ]
        out.append(
            _table(
                ["epoch", "images", "seconds", "images/s", "loss", "test accuracy", ""],
                rows,
                f'class="epochs" data-run="{rid}"',
            )
        )
    out.append("</section>")
    return "".join(out)


def _time(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "–"
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def render_tables(status: Mapping[str, Any], *, max_columns: int = 64) -> str:
    """The page's content (workers, servers, training, events) as an HTML fragment, for
    notebooks: ``IPython.display.HTML(render_tables(status))``."""
    out = [
        '<div id="adam">',
        "<style>" + _STYLE + "</style>",
        f'<p class="muted updated">updated {_time(status.get("time"))}</p>',
    ]
    workers = status.get("workers") or []
    out.append('<section id="workers"><h2>Workers</h2>')
    out.append(
        _table(
            ["role", "name", "address"],
            [
                [_fmt(w.get("role")), _fmt(w.get("name")), f"<code>{escape(w['address'])}</code>"]
                for w in workers
            ],
            'class="workers"',
        )
    )
    out.append("</section>")
    servers = status.get("servers") or []
    if not servers:
        out.append(
            '<section><p class="muted">No parameter server on this scheduler yet.</p></section>'
        )
    out += [_server_html(s, max_columns) for s in servers]
    out.append(_training_html(status.get("training") or []))
    events = status.get("events") or []
    out.append('<section id="events"><h2>Parameter-server events</h2>')
    if events:
        rows = []
        for ev in events:
            rest = {k: v for k, v in ev.items() if k not in ("time", "event", "server")}
            rows.append(
                [
                    _time(ev.get("time")),
                    _fmt(ev.get("event")),
                    _fmt(ev.get("server")),
                    escape(json.dumps(rest, default=str)),
                ]
            )
        out.append(_table(["time", "event", "server", "details"], rows, 'class="events"'))
    else:
        out.append('<p class="muted">No worker lost so far.</p>')
    out.append("</section></div>")
    return "".join(out)


def render_page(status: Mapping[str, Any], refresh: float, *, max_columns: int = 64) -> str:
    """The whole ``/adam`` page; ``refresh`` seconds between in-place updates (0: none).

    Links are relative to ``/adam``, so the page works under any dashboard prefix (a gateway's
    ``/clusters/<name>/``).
    """
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        "<title>Adam: parameter server and training</title>"
        "<meta name=viewport content='width=device-width,initial-scale=1'></head><body>"
        '<header><h1>Adam</h1><a href="status">Dask dashboard</a>'
        '<a href="adam/status.json">status.json</a></header><main>'
        + render_tables(status, max_columns=max_columns)
        + "</main><script>"
        + _SCRIPT % int(max(0.0, refresh) * 1000)
        + "</script></body></html>"
    )
