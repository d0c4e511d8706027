"""Training history, live progress and plots.

:class:`History` holds one record per epoch (loss, test accuracy, images/s, seconds, stall
fraction, parameter-server update rate, replication and write-back lag) and appends each to a
JSONL file as it arrives, so a crashed or interrupted run keeps what it measured. :class:`Progress`
is a tqdm bar (the notebook widget in Jupyter, text in a terminal) fed from replica reports.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["EpochProgress", "History", "Progress"]

logger = logging.getLogger(__name__)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    return v


class History:
    """Per-epoch records of a training run, optionally mirrored to a JSONL file.

    Parameters
    ----------
    path : str, optional
        A local path or fsspec URL; each record is appended as one JSON line when added.
    records : iterable of dict, optional
        Records to start from (a resumed run continues its history).
    """

    def __init__(
        self,
        path: str | None = None,
        records: Iterable[dict] | None = None,
        storage_options: dict | None = None,
    ):
        self.path = path
        self.storage_options = storage_options
        self.records: list[dict] = [dict(r) for r in (records or [])]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __repr__(self) -> str:
        last = self.records[-1] if self.records else {}
        return (
            f"History({len(self.records)} epochs, last test_accuracy={last.get('test_accuracy')})"
        )

    def append(self, record: dict) -> None:
        rec = {k: _jsonable(v) for k, v in record.items()}
        self.records.append(rec)
        if self.path:
            self._write_line(self.path, rec)

    def _write_line(self, path: str, rec: dict) -> None:
        line = json.dumps(rec) + "\n"
        if "://" not in path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a") as f:
                f.write(line)
            return
        self.save(path, self.storage_options)  # object stores have no append

    def save(self, path: str, storage_options: dict | None = None) -> None:
        """Write every record to ``path`` (any fsspec URL) as JSON lines, replacing it."""
        import fsspec

        with fsspec.open(path, "w", **(storage_options or {})) as f:
            f.writelines(json.dumps(r) + "\n" for r in self.records)

    def column(self, name: str) -> list:
        return [r.get(name) for r in self.records]

    @property
    def last(self) -> dict | None:
        return self.records[-1] if self.records else None

    @property
    def best_accuracy(self) -> float | None:
        accs = [a for a in self.column("test_accuracy") if a is not None]
        return max(accs) if accs else None

    @classmethod
    def load(cls, path: str, storage_options: dict | None = None) -> History:
        """Read a JSONL history file (records stay in memory; ``path`` is not written)."""
        import fsspec

        with fsspec.open(path, "r", **(storage_options or {})) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return cls(records=records)

    def plot(self, ax=None):
        """Loss and test accuracy per epoch (matplotlib); returns the figure."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("plotting needs matplotlib: pip install 'adam_dask[plot]'") from exc
        if ax is None:
            fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
        else:
            ax_loss, ax_acc = ax
            fig = ax_loss.figure
        epochs = self.column("epoch")
        ax_loss.plot(epochs, self.column("loss"), marker="o")
        ax_loss.set(xlabel="epoch", ylabel="training loss", title="loss")
        acc = [None if a is None else 100 * a for a in self.column("test_accuracy")]
        ax_acc.plot(epochs, acc, marker="o", color="tab:green", label="weights")
        averaged = [
            (r["epoch"], 100 * r["average_accuracy"]) for r in self if "average_accuracy" in r
        ]
        if averaged:  # tail averaging was on: its curve beside the weights' own
            ax_acc.plot(*zip(*averaged), marker=".", color="tab:purple", label="tail average")
            ax_acc.legend()
        ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
        for a in (ax_loss, ax_acc):
            a.grid(alpha=0.3)
        fig.tight_layout()
        return fig


class Progress:
    """A tqdm progress bar over the images of an epoch, with loss and speed in its postfix.

    Disabled (``enabled=False``) it does nothing, so library code can always call it.
    """

    def __init__(self, total: int, *, desc: str = "", enabled: bool = True, position: int = 0):
        self.bar = None
        self.n = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total,
                desc=desc,
                unit="img",
                unit_scale=True,
                leave=True,
                position=position,
                dynamic_ncols=True,
            )

    def update_to(self, n: int, **postfix) -> None:
        if self.bar is None:
            self.n = n
            return
        n = min(n, self.bar.total or n)
        if n > self.n:
            self.bar.update(n - self.n)
            self.n = n
        if postfix:
            self.bar.set_postfix(
                {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                refresh=False,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EpochProgress:
    """The replicas' progress through the epochs of one run, as they report it (the
    ``PROGRESS_TOPIC`` events of ``task.py``): the images each replica drew this epoch
    (:attr:`images`), the worker each runs on (:attr:`workers`) and their sum on a
    :class:`Progress` bar. The dicts are cleared in place at each epoch's start, so a reference
    to them stays current."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.epoch: int | None = None
        self.images: dict[int, int] = {}  # replica -> images drawn this epoch
        self.workers: dict[int, str] = {}  # replica -> its worker, this epoch
        self._bar: Progress | None = None
        self._lock = threading.Lock()

    def begin(self, epoch: int, total: int, enabled: bool = True) -> None:
        """Epoch ``epoch`` starts, of ``total`` images: counts anew, a bar opened (shown when
        ``enabled``)."""
        with self._lock:
            self.epoch = epoch
            self.images.clear()
            self.workers.clear()
        self._bar = Progress(total, desc=f"epoch {epoch + 1}", enabled=enabled)

    def end(self) -> None:
        """The epoch is over: its bar closed (its counts kept)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_event(self, event: Any) -> None:
        """A replica's report (a topic event: ``(time, message)``); others runs' are ignored."""
        _, msg = event
        if msg.get("run") != self.run_id or msg.get("epoch") != self.epoch:
            return
        with self._lock:
            self.images[msg["replica"]] = msg["images"]
            self.workers[msg["replica"]] = msg.get("worker")
            total = sum(self.images.values())
        bar = self._bar
        if bar is not None:
            bar.update_to(total)
