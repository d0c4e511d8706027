"""The parameter server's checkpoint: a Zarr v3 group at any fsspec URL, plus a manifest.

Format (no pickles; safe to open from an untrusted place)::

    <url>/zarr.json              the Zarr v3 group
    <url>/params/...             flat float32 array, one chunk per shard (chunks = shard floats)
    <url>/manifest.json          written last: format, size, shard_bytes, shard ranges,
                                 per-shard versions, epoch, meta (model spec etc.), layout, time

Write path: every PS node writes its dirty primaries (:class:`CheckpointWriter.write`, called in
a thread by :class:`~adam_dask.ps.node.PSNode` every ``adam.ps.writeback-interval``): the chunks
first, then it merges the versions of the shards it just wrote into ``manifest.json``. A chunk is
one whole object (a Zarr chunk per shard, written atomically by LocalStore and by S3 PUT), so a
reader never sees a torn shard, and because the data is written before the manifest names its
version, a manifest's versions are never ahead of the data: a version in the manifest is a lower
bound of the data's (concurrent merges by two nodes can only make it lower). ``flush()`` on the
server writes the exact manifest after every node has written everything.

A new checkpoint deletes an old manifest before touching any data, so no reader ever pairs an
old manifest with new data. ``memory://`` URLs are per process: they work only when the PS
workers share the client's process.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..storage import filesystem, normalize_url, zarr_store

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "adam-ps-checkpoint"
FORMAT_VERSION = 1


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def write_json(fs: Any, path: str, obj: dict) -> None:
    """Write ``obj`` as JSON at ``path`` in one step (rename on local disks, one PUT on object
    stores), so a reader sees the old or the new document, never half of one."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def read_manifest(url: str, storage_options: dict | None = None) -> dict:
    """The manifest of the checkpoint at ``url``; :class:`CheckpointError` if there is none
    (no complete checkpoint) or it is not one of ours."""
    fs, path = filesystem(url, storage_options)
    mpath = _join(path, MANIFEST)
    try:
        raw = fs.cat_file(mpath)
    except FileNotFoundError:
        raise CheckpointError(
            f"no complete checkpoint at {normalize_url(url)} ({MANIFEST} is missing)",
            "check the URL, or flush the server first",
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"cannot read {mpath}: {exc}", "check the storage endpoint and credentials"
        ) from exc
    try:
        m = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{mpath} is not valid JSON: {exc}") from exc
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(
            f"{mpath} is not an adam_dask parameter-server manifest", f"expected format {FORMAT!r}"
        )
    if int(m.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath} has format version {m['format_version']}, newer than {FORMAT_VERSION}",
            "upgrade adam_dask",
        )
    return m


def init_checkpoint(
    url: str,
    storage_options: dict | None,
    *,
    size: int,
    shard_bytes: int,
    shards: list[tuple[int, int]],
    values: np.ndarray | None = None,
    versions: list[int] | None = None,
    epoch: int | None = None,
    meta: dict | None = None,
    layout: dict | None = None,
    server_id: str | None = None,
) -> dict:
    """Create (or replace) the checkpoint at ``url`` holding ``values`` (zeros by default), and
    write its manifest last. Returns the manifest."""
    import zarr

    fs, path = filesystem(url, storage_options)
    mpath = _join(path, MANIFEST)
    try:
        if fs.exists(mpath):
            fs.rm_file(mpath)  # no reader may pair the old manifest with the new data
        store = zarr_store(url, storage_options, read_only=False)
        g = zarr.open_group(store=store, mode="w", zarr_format=3)
        per = shards[0][1] - shards[0][0]
        arr = g.create_array(
            "params",
            shape=(size,),
            chunks=(per,),
            dtype="float32",
            fill_value=0.0,
            compressors=None,
            dimension_names=("flat",),
        )
        if values is not None:
            arr[:] = np.asarray(values, dtype=np.float32)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"cannot create the checkpoint at {normalize_url(url)}: {exc}",
            "check the URL, the credentials and free space",
        ) from exc
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "size": int(size),
        "shard_bytes": int(shard_bytes),
        "shards": [[int(a), int(b)] for a, b in shards],
        "versions": [int(v) for v in (versions or [0] * len(shards))],
        "epoch": epoch,
        "meta": meta or {},
        "layout": layout,
        "server": server_id,
        "time": time.time(),
    }
    _put_manifest(fs, mpath, manifest, url)
    return manifest


def _put_manifest(fs: Any, mpath: str, manifest: dict, url: str) -> None:
    try:
        write_json(fs, mpath, manifest)
    except Exception as exc:
        raise CheckpointError(
            f"cannot write the manifest of {normalize_url(url)}: {exc}",
            "check the storage; the data is kept and the write retried",
        ) from exc


def write_manifest(
    url: str,
    storage_options: dict | None,
    versions: dict[int, int],
    *,
    epoch: Any = None,
    meta: dict | None = None,
) -> dict:
    """Merge ``versions`` ({sid: version}), and ``epoch``/``meta`` when given, into the manifest
    of the checkpoint at ``url``; the data must already be written."""
    fs, path = filesystem(url, storage_options)
    m = read_manifest(url, storage_options)
    for sid, v in versions.items():
        m["versions"][int(sid)] = int(v)
    if epoch is not None:
        m["epoch"] = epoch
    if meta is not None:
        m["meta"] = meta
    m["time"] = time.time()
    _put_manifest(fs, _join(path, MANIFEST), m, url)
    return m


def read_checkpoint(url: str, storage_options: dict | None = None) -> tuple[dict, np.ndarray]:
    """(manifest, flat float32 values) of the last complete checkpoint at ``url``."""
    import zarr

    m = read_manifest(url, storage_options)
    try:
        g = zarr.open_group(store=zarr_store(url, storage_options, read_only=True), mode="r")
        values = np.asarray(g["params"][:], dtype=np.float32)
    except Exception as exc:
        raise CheckpointError(
            f"the checkpoint at {normalize_url(url)} has a manifest but its "
            f"params cannot be read: {exc}",
            "the checkpoint is damaged",
        ) from exc
    if values.shape != (int(m["size"]),):
        raise CheckpointError(
            f"the checkpoint at {normalize_url(url)} holds {values.shape[0]} "
            f"values, its manifest says {m['size']}",
            "the checkpoint is damaged",
        )
    return m, values


class CheckpointWriter:
    """Writes snapshots of shards into the checkpoint at ``url`` (sync; call it in a thread).

    Opening is lazy and retried by the caller, so a writer made while storage is down works once
    it comes back.
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.storage_options = storage_options
        self._array = None

    def _params(self):
        if self._array is None:
            import zarr

            store = zarr_store(self.url, self.storage_options, read_only=False)
            self._array = zarr.open_array(store=store, path="params", mode="r+")
        return self._array

    def write(self, snaps: Iterable[Any]) -> dict[int, int]:
        """Write each snapshot's values (its whole chunk), then merge the versions into the
        manifest. Raises on any storage error (the caller retries; nothing is lost)."""
        snaps = list(snaps)
        arr = self._params()
        for s in snaps:
            arr[s.start : s.stop] = s.values
        versions = {s.shard: s.version for s in snaps}
        write_manifest(self.url, self.storage_options, versions)
        logger.debug("checkpoint %s: wrote shards %s", self.url, versions)
        return versions
