"""The Trainer's side of a checkpoint: refuse to overwrite one, its history file, and the state a
resumed run starts from (weights, epoch, history, plan and settings)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DestinationExistsError
from .metrics import History

__all__ = [
    "AVERAGE",
    "HISTORY",
    "Resumed",
    "history_url",
    "load_average",
    "refuse_existing",
    "resumed_state",
    "save_average",
]

logger = logging.getLogger(__name__)

HISTORY = "history.jsonl"
AVERAGE = "average"  # the tail average's float64 sum, a Zarr array beside the shards

# the stored settings a resumed run keeps unless the caller gives new ones
_RESUMABLE = (
    "mode",
    "push_every",
    "lr",
    "lr_schedule",
    "lr_floor",
    "lr_warmup",
    "lr_replicas",
    "momentum",
    "batch_size",
    "threads",
    "seed",
    "epoch_quorum",
    "offload_dense",
    "average_from",
)


def refuse_existing(url: str, storage_options: dict | None) -> None:
    """A new run must not write over a checkpoint that holds another run's weights."""
    from ..ps.checkpoint import MANIFEST
    from ..storage import filesystem

    fs, path = filesystem(url, storage_options)
    if fs.exists(path.rstrip("/") + "/" + MANIFEST):
        raise DestinationExistsError(
            f"a checkpoint already exists at {url}",
            "continue it with --resume (Trainer.resume), replace it with --overwrite "
            "(overwrite=True), or choose another URL",
        )


def history_url(checkpoint: str) -> str:
    from ..storage import normalize_url

    return normalize_url(checkpoint) + "/" + HISTORY


def save_average(checkpoint: str, average: Any, storage_options: dict | None) -> None:
    """Write a :class:`~._average.TailAverage` into the checkpoint (whole, once per epoch:
    the sum is the size of the model), so a resumed run goes on averaging."""
    import zarr

    from ..storage import join_url, normalize_url, zarr_store

    total, attrs = average.state()
    if total is None:
        return
    url = join_url(normalize_url(checkpoint), AVERAGE)
    arr = zarr.create_array(
        store=zarr_store(url, storage_options, read_only=False),
        shape=total.shape,
        dtype="float64",
        chunks=total.shape,
        attributes=attrs,
        overwrite=True,
    )
    arr[...] = total


def load_average(checkpoint: str, storage_options: dict | None, next_epoch: int) -> Any:
    """The tail average stored in the checkpoint, without the epochs a resumed run trains
    again (from ``next_epoch`` on); None when the checkpoint holds none."""
    import zarr

    from ..storage import join_url, normalize_url, zarr_store
    from ._average import TailAverage

    url = join_url(normalize_url(checkpoint), AVERAGE)
    try:
        arr = zarr.open_array(store=zarr_store(url, storage_options), mode="r")
    except (FileNotFoundError, zarr.errors.NodeNotFoundError, zarr.errors.ArrayNotFoundError):
        return None
    attrs: dict[str, Any] = dict(arr.attrs)
    if any(int(e) >= next_epoch for e in attrs.get("epochs") or ()):
        # the average is written after the shards' flush: an epoch it holds that the shards'
        # manifest does not is trained again, and averaged again, so drop the stored mean
        logger.warning(
            "the weight average at %s holds epochs the checkpoint does not; it starts anew", url
        )
        return TailAverage(start_epoch=int(attrs["start_epoch"]))
    return TailAverage.from_state(np.asarray(arr[...]), attrs)


@dataclass(frozen=True, slots=True)
class Resumed:
    """What a resumed Trainer starts from."""

    net: Any  # Network holding the checkpoint's weights
    data: str
    settings: dict  # keywords for the Trainer: the caller's, else the stored ones
    records: list[dict]
    epoch: int  # the next epoch to train
    epochs: int | None  # the run's planned total
    mode: str | None  # the stored mode


def resumed_state(
    server: Any, checkpoint: str, data: str | None, storage_options: dict | None, given: dict
) -> Resumed:
    """The state in the checkpoint that ``server`` was restored from; ``given`` are the
    caller's Trainer keywords (None = keep the stored setting)."""
    from ..model.network import Network
    from ..storage import options_for

    meta = server.meta or {}
    net = Network.from_dict(meta["model"])
    net.flat = server.pull()
    kwargs = dict(given)
    stored = dict(meta.get("settings") or {"mode": meta.get("mode")})
    for name, value in stored.items():
        if name in _RESUMABLE and kwargs.get(name) is None:
            kwargs[name] = value
    url = history_url(checkpoint)
    try:
        records = History.load(url, options_for(url, storage_options)).records
    except FileNotFoundError:
        logger.warning("no history at %s; the resumed run starts a new one", url)
        records = []
    epoch = int(server.epoch) + 1 if server.epoch is not None else len(records)
    return Resumed(
        net=net,
        data=data or meta["data"],
        settings=kwargs,
        records=records,
        epoch=epoch,
        epochs=meta.get("epochs"),
        mode=meta.get("mode"),
    )
