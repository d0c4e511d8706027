"""The parameter server's checkpoint: a Zarr v3 group at any fsspec URL, plus a manifest.

Format 2 (no pickles; safe to open from an untrusted place)::

    <url>/zarr.json                      the Zarr v3 group
    <url>/shards/<sid>/g<gen>-v<version> one block: a float32 Zarr array of the shard's values
                                         (one chunk), attributes: shard, start, stop, version,
                                         generation, the ids of the pushes it holds and the
                                         data positions (marks) its values hold
    <url>/manifest.json                  format, size, shard_bytes, shard ranges, per shard the
                                         block, version and generation; epoch, meta, layout,
                                         sequence, time

Blocks are immutable: a primary writes a new one for each write-back, named by its generation
and version, so nothing ever overwrites data a manifest names, and a primary that lost its
place (a frozen node that wakes up) can only add a block nobody names. The manifest has one
writer, the controller (:mod:`adam_dask.ps.protocol.controller`): it names a block only after its data
is written and only from the shard's primary of the current generation; its sequence number and
each shard's ``(generation, version)`` never go back. A block is deleted two manifests after
the last one naming it (a reader of the previous manifest finds its data), and blocks no manifest
names are swept when a server starts.

Format 1 (``params``, one chunk per shard, rewritten in place) is still read. Reading (the
manifest's checks, the blocks, the values) is :mod:`adam_dask.checkpoint_io`'s, below both the
model and this package, re-exported here.

``memory://`` URLs are per process: they work only when the PS workers share the client's
process.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
import uuid
from typing import Any

import numpy as np

from ..._secrets import redact_urls
from ...checkpoint_io import (
    BLOCKS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    manifest_problem,
    read_block,
    read_checkpoint,
    read_manifest,
    split_block,
)
from ...errors import CheckpointError
from ...storage import filesystem, join_url, normalize_url, zarr_store
from ..protocol.shard import Mark, ShardCopy

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "BlockStore",
    "block_path",
    "init_checkpoint",
    "manifest_problem",
    "manifest_unreachable",
    "put_manifest",
    "read_checkpoint",
    "read_manifest",
    "read_marks",
    "read_states",
    "split_block",
]


def block_path(sid: int, gen: int, version: int) -> str:
    """Where the block of shard ``sid`` at ``(gen, version)`` lives inside the checkpoint."""
    return f"{BLOCKS}/{sid}/g{gen}-v{version}"


def _encode_ids(ids: Any) -> str:
    return base64.b64encode(np.asarray(list(ids), dtype="<i8").reshape(-1, 2).tobytes()).decode()


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


def put_manifest(url: str, storage_options: dict | None, doc: dict) -> None:
    """Write ``doc`` as the manifest (the controller's one write; raises on storage errors).
    URLs in it (the training data's, in ``meta``) are stored without their credentials; the
    messages of errors (:class:`CheckpointError`) never show credentials either."""
    fs, path = filesystem(url, storage_options)
    write_json(fs, join_url(path, MANIFEST), {**redact_urls(doc), "time": time.time()})


def manifest_unreachable(url: str, storage_options: dict | None, doc: dict) -> str | None:
    """What keeps this process (the scheduler, the manifest's writer) from the checkpoint whose
    manifest ``doc`` another process (the job) has just written at ``url``, or None.

    It reads the manifest back (the same server, sequence and blocks: the same storage, not a
    folder of the same name on another disk) and writes ``doc`` there again, the one operation the
    controller needs. A path that does not exist here is not created."""
    fs, path = filesystem(url, storage_options)
    mpath = join_url(path, MANIFEST)
    try:
        found = json.loads(fs.cat_file(mpath))
    except Exception as exc:
        return f"cannot read {mpath}: {type(exc).__name__}: {exc}"

    def key(m: Any) -> tuple:  # a message may bring lists as tuples
        if not isinstance(m, dict):
            return (None,)
        return (m.get("server"), m.get("sequence"), [str(b) for b in m.get("blocks") or ()])

    if key(found) != key(doc):
        return f"{mpath} is not the manifest the job wrote there: another storage"
    try:
        put_manifest(url, storage_options, doc)
    except Exception as exc:
        return f"cannot write {mpath}: {type(exc).__name__}: {exc}"
    return None


class BlockStore:
    """Reads and writes the blocks of the checkpoint at ``url`` (sync; call it in a thread).
    Opening is lazy, so a store made while storage is down works once it comes back."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.storage_options = storage_options
        self._store: Any = None

    def _zarr(self) -> Any:
        if self._store is None:
            self._store = zarr_store(self.url, self.storage_options, read_only=False)
        return self._store

    def write(self, snap: ShardCopy) -> str:
        """Write ``snap`` as a new block; returns its path. Raises on storage errors."""
        import zarr

        path = block_path(snap.shard, snap.gen, snap.version)
        parts = snap.payloads()
        n = (snap.stop - snap.start) * len(parts)
        arr = zarr.create_array(
            store=self._zarr(),
            name=path,
            shape=(n,),
            chunks=(n,),
            dtype="float32",
            compressors=None,
            fill_value=0.0,
            overwrite=True,
            attributes={
                "shard": snap.shard,
                "start": snap.start,
                "stop": snap.stop,
                "version": snap.version,
                "generation": snap.gen,
                "ids": _encode_ids(snap.ids),
                "marks": [m.to_json() for m in snap.marks],
                "state_vectors": len(parts) - 1,  # the optimizer's momentum after the values
            },
        )
        arr[:] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return path

    def read(self, path: str) -> tuple[np.ndarray, dict, tuple[tuple[int, int], ...]]:
        """(values, attributes, push ids) of the block at ``path``."""
        return read_block(self._zarr(), path)

    def read_snapshot(self, path: str) -> ShardCopy:
        """The block at ``path`` as the copy it holds: values, version, generation, push ids,
        data positions and the optimizer's state."""
        block, attrs, ids = self.read(path)
        values, state = split_block(block, attrs)
        return ShardCopy(
            int(attrs["shard"]),
            int(attrs["start"]),
            int(attrs["stop"]),
            int(attrs["version"]),
            values,
            ids,
            int(attrs["generation"]),
            True,
            block_marks(attrs),
            state,
        )

    def delete(self, paths: list[str] | tuple[str, ...]) -> None:
        fs, root = filesystem(self.url, self.storage_options)
        for p in paths:
            try:
                fs.rm(join_url(root, p), recursive=True)
            except FileNotFoundError:
                pass

    def orphans(self, named: set[str]) -> list[str]:
        """Blocks in storage that ``named`` does not list (left by a writer that lost its
        place, or by a crash between a write and its report)."""
        fs, root = filesystem(self.url, self.storage_options)
        base = join_url(root, BLOCKS)
        found = []
        try:
            shard_dirs = fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        for d in shard_dirs:
            if not fs.isdir(d):
                continue
            for b in fs.ls(d, detail=False):
                rel = f"{BLOCKS}/{b.rstrip('/').rsplit('/', 2)[-2]}/{b.rstrip('/').rsplit('/', 1)[-1]}"
                if fs.isdir(b) and rel not in named:
                    found.append(rel)
        return found


def block_marks(attrs: dict) -> tuple[Mark, ...]:
    """The data positions a block's values hold (none in blocks written before them)."""
    return tuple(Mark.from_json(m) for m in attrs.get("marks") or ())


def read_marks(
    url: str, storage_options: dict | None, manifest: dict
) -> dict[int, tuple[Mark, ...]]:
    """{shard: the marks of its block} of the blocks ``manifest`` names (format 2)."""
    if int(manifest.get("format_version", 1)) < 2:
        return {}
    import zarr

    reader = BlockStore(url, storage_options)
    out = {}
    for sid, path in enumerate(manifest["blocks"]):
        arr = zarr.open_array(store=reader._zarr(), path=path, mode="r")
        out[sid] = block_marks(dict(arr.attrs))
    return out


def read_states(url: str, storage_options: dict | None, manifest: dict) -> dict[int, np.ndarray]:
    """{shard: the server optimizer's state of its block} of the blocks ``manifest`` names
    that hold one (format 2)."""
    if int(manifest.get("format_version", 1)) < 2:
        return {}
    reader = BlockStore(url, storage_options)
    out = {}
    for sid, path in enumerate(manifest["blocks"]):
        block, attrs, _ = reader.read(path)
        _, state = split_block(block, attrs)
        if state is not None:
            out[sid] = state
    return out


def init_checkpoint(
    url: str,
    storage_options: dict | None,
    *,
    size: int,
    shard_bytes: int,
    shards: list[tuple[int, int]],
    values: np.ndarray | None = None,
    versions: list[int] | None = None,
    generation: int = 0,
    epoch: int | None = None,
    meta: dict | None = None,
    layout: dict | None = None,
    server_id: str | None = None,
    optimizer: dict | None = None,
    states: dict[int, np.ndarray] | None = None,
) -> dict:
    """Create (or replace) the checkpoint at ``url`` holding ``values`` (zeros by default) at
    ``versions``, and write its manifest last. Returns the manifest."""
    import zarr

    fs, path = filesystem(url, storage_options)
    mpath = join_url(path, MANIFEST)
    versions = [int(v) for v in (versions or [0] * len(shards))]
    values = np.zeros(size, np.float32) if values is None else np.asarray(values, np.float32)
    blocks = []
    try:
        if fs.exists(mpath):
            fs.rm_file(mpath)  # no reader may pair the old manifest with the new data
        store = zarr_store(url, storage_options, read_only=False)
        zarr.open_group(store=store, mode="w", zarr_format=3)
        writer = BlockStore(url, storage_options)
        for sid, (a, b) in enumerate(shards):
            state = None
            if (optimizer or {}).get("kind") == "nesterov":
                state = (states or {}).get(sid, np.zeros(b - a, np.float32))
            snap = ShardCopy(sid, a, b, versions[sid], values[a:b], (), generation, state=state)
            blocks.append(writer.write(snap))
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
        "versions": versions,
        "generations": [int(generation)] * len(shards),
        "blocks": blocks,
        "epoch": epoch,
        "meta": meta or {},
        "layout": layout,
        "server": server_id,
        "optimizer": optimizer,
        "sequence": 0,
    }
    try:
        put_manifest(url, storage_options, manifest)
    except Exception as exc:
        raise CheckpointError(
            f"cannot write the manifest of {normalize_url(url)}: {exc}",
            "check the storage and try again",
        ) from exc
    return manifest
