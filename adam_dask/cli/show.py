"""``adam-dask show RUN``: a finished (or interrupted) run looked at from its run folder.

It reads the history the run appended every epoch (``history.jsonl``) and, when there is one,
the checkpoint's manifest (the model, the mode, the epochs planned), prints a table of the
epochs on stderr, writes the curves (loss, test accuracy, images/s per epoch) as a PNG, and
ends with one JSON line: the run's summary. Nothing is trained and no cluster is started.
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
from typing import Any

from .. import config
from ..errors import CheckpointError, ConfigError
from ..storage import filesystem, join_url, normalize_url, redact_url
from ._common import add_storage

logger = logging.getLogger(__name__)

__all__ = ["cmd_show", "draw_curves", "register", "summary"]


def register(sub) -> None:
    """Add the ``show`` sub-command to ``sub`` (argparse sub-parsers)."""
    p = sub.add_parser(
        "show", help="a run's summary and its curves (loss, accuracy, images/s) as a PNG"
    )
    p.add_argument(
        "run",
        metavar="RUN",
        help="the run folder (the checkpoint URL `adam-dask train` printed when it started)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--png",
        metavar="FILE",
        default=None,
        help="where to write the curves (default RUN/"
        f"{config.get('cli.show-curves')}, adam.cli.show-curves)",
    )
    g.add_argument("--no-png", action="store_true", help="print the summary only")
    add_storage(p)
    p.set_defaults(func=cmd_show)


def _history(run: str, storage_options: dict | None) -> list[dict]:
    from ..train.metrics import History
    from ..train.run_state import history_url

    url = history_url(run)
    try:
        records = History.load(url, storage_options).records
    except FileNotFoundError:
        raise ConfigError(
            f"no training history at {redact_url(url)}",
            "give a run folder (the checkpoint `adam-dask train` printed when it started)",
        ) from None
    except ValueError as exc:  # a line that is not JSON
        raise ConfigError(
            f"{redact_url(url)} is not a training history ({exc})",
            "give a run folder written by adam-dask train",
        ) from None
    if not records:
        raise ConfigError(
            f"the run at {redact_url(run)} has no finished epoch yet",
            "look again once its first epoch has ended",
        )
    return records


def summary(run: str, records: list[dict], manifest: dict | None) -> dict[str, Any]:
    """The JSON summary of a run from its history ``records`` and checkpoint ``manifest``."""
    scored = [r for r in records if r.get("test_accuracy") is not None]
    best = max(scored, key=lambda r: r["test_accuracy"]) if scored else None
    images = sum(r.get("images") or 0 for r in records)
    seconds = sum(r.get("seconds") or 0.0 for r in records)
    last = records[-1]
    meta = (manifest or {}).get("meta") or {}
    model = meta.get("model") or {}
    out: dict[str, Any] = {
        "run": redact_url(run),
        "epochs": len(records),
        "epoch": last.get("epoch"),
        "epochs_planned": meta.get("epochs"),
        "test_accuracy": last.get("test_accuracy"),
        "best_accuracy": best["test_accuracy"] if best else None,
        "best_epoch": best["epoch"] if best else None,
        "loss": last.get("loss"),
        "seconds": round(seconds, 3),
        "images_per_second": round(images / seconds, 1) if seconds else 0.0,
        "images_applied": sum(r.get("images_applied") or 0 for r in records),
        "mode": meta.get("mode"),
        "model": model.get("factory") or model.get("spec"),
        "checkpoint_epoch": (manifest or {}).get("epoch"),
    }
    if "average_accuracy" in last:
        out["average_accuracy"] = last["average_accuracy"]
    return out


def _table(records: list[dict]) -> str:
    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.2f}%"

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [f"{'epoch':>5} {'loss':>8} {'accuracy':>9} {'images/s':>9} {'seconds':>8}"]
    for r in records:
        lines.append(
            f"{num(r.get('epoch'), 'd'):>5} {num(r.get('loss'), '.4f'):>8} "
            f"{pct(r.get('test_accuracy')):>9} {num(r.get('images_per_second'), ',.0f'):>9} "
            f"{num(r.get('seconds'), '.1f'):>8}"
        )
    return "\n".join(lines)


def _figure_class() -> Any:
    """matplotlib's Figure (no pyplot: no GUI backend, no global state), or the error line."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "drawing the curves needs matplotlib, which is not installed",
            "pip install 'adam_dask[plot]', or give --no-png",
        ) from None
    return Figure


def draw_curves(records: list[dict], title: str = "") -> bytes:
    """The curves of a run as PNG bytes: loss, test accuracy (and the tail average's) and
    images/s per epoch, as the notebook's ``History.plot`` draws the first two."""
    Figure = _figure_class()
    from ..train.metrics import History

    fig = Figure(figsize=(14, 3.8))
    ax_loss, ax_acc, ax_speed = fig.subplots(1, 3)
    history = History(records=records)
    history.plot(ax=(ax_loss, ax_acc))
    ax_speed.plot(history.column("epoch"), history.column("images_per_second"), marker="o")
    ax_speed.set(xlabel="epoch", ylabel="images/s", title="training speed")
    ax_speed.set_ylim(bottom=0)
    ax_speed.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_loss, ax_acc, ax_speed):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def cmd_show(args: argparse.Namespace) -> dict:
    from ..checkpoint_io import read_manifest

    so = args.storage_options
    if not args.no_png:
        _figure_class()  # a missing matplotlib is one error line, before any output
    run = normalize_url(args.run).rstrip("/")
    records = _history(run, so)
    try:
        manifest: dict | None = read_manifest(run, so)
    except CheckpointError as exc:  # an interrupted run's history without a checkpoint yet
        logger.info("no checkpoint manifest beside the history: %s", exc)
        manifest = None
    result = summary(run, records, manifest)
    sys.stderr.write(_table(records) + "\n")
    result["curves"] = None
    if not args.no_png:
        png = args.png or join_url(run, str(config.get("cli.show-curves")))
        name = run.rsplit("/", 1)[-1]
        data = draw_curves(records, title=f"{name} ({result['model'] or 'model unknown'})")
        fs, path = filesystem(png, so)
        fs.pipe_file(path, data)
        result["curves"] = redact_url(png)
        sys.stderr.write(f"curves: {redact_url(png)}\n")
    return result
