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
writer, the controller (:mod:`adam_dask.ps._controller`): it names a block only after its data
is written and only from the shard's primary of the current generation; its sequence number and
each shard's ``(generation, version)`` never go back. A block is deleted two manifests after
the last one naming it (a reader of the previous manifest finds its data), and blocks no manifest
names are swept when a server starts.

Format 1 (``params``, one chunk per shard, rewritten in place) is still read.

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

from .._secrets import redact_urls
from ..errors import CheckpointError
from ..storage import filesystem, join_url, normalize_url, zarr_store
from .state import Mark, Snapshot

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "BlockStore",
    "block_path",
    "init_checkpoint",
    "manifest_unreachable",
    "put_manifest",
    "read_checkpoint",
    "read_manifest",
    "read_marks",
]

MANIFEST = "manifest.json"
FORMAT = "adam-ps-checkpoint"
FORMAT_VERSION = 2
BLOCKS = "shards"


def block_path(sid: int, gen: int, version: int) -> str:
    """Where the block of shard ``sid`` at ``(gen, version)`` lives inside the checkpoint."""
    return f"{BLOCKS}/{sid}/g{gen}-v{version}"


def _encode_ids(ids: Any) -> str:
    return base64.b64encode(np.asarray(list(ids), dtype="<i8").reshape(-1, 2).tobytes()).decode()


def _decode_ids(text: str) -> tuple[tuple[int, int], ...]:
    a = np.frombuffer(base64.b64decode(text), dtype="<i8").reshape(-1, 2)
    return tuple((int(v), int(p)) for v, p in a)


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


def read_manifest(url: str, storage_options: dict | None = None) -> dict:
    """The manifest of the checkpoint at ``url``; :class:`CheckpointError` if there is none
    (no complete checkpoint) or it is not one of ours."""
    fs, path = filesystem(url, storage_options)
    mpath = join_url(path, MANIFEST)
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
    if int(m.get("format_version", 1)) >= 2:
        problem = manifest_problem(m)
        if problem:
            raise CheckpointError(
                f"{mpath} is not a sound checkpoint manifest: {problem}",
                "restore from a checkpoint this parameter server wrote",
            )
    return m


# A manifest is read from storage that may not be ours to trust: everything it names is
# checked before a byte is allocated for it or a path is opened.
_MAX_BYTES_FRACTION = 0.5  # of this machine's available memory, for the flat values
_CODECS = {"bytes", "blosc", "zstd", "gzip", "crc32c", "transpose"}  # zarr v3, none executes code


def manifest_problem(m: dict) -> str | None:
    """What is wrong with a (format 2) manifest's layout, or None: sizes, shards, blocks,
    versions consistent, the values small enough to hold, block paths inside the checkpoint."""
    try:
        size = int(m["size"])
        shards = [(int(a), int(b)) for a, b in m["shards"]]
        blocks, versions = list(m["blocks"]), [int(v) for v in m["versions"]]
        shard_floats = int(m["shard_bytes"]) // 4
    except (KeyError, TypeError, ValueError) as exc:
        return f"a missing or malformed field ({exc!r})"
    if size <= 0 or not shards or shards[0][0] != 0 or shards[-1][1] != size:
        return f"shards {shards[:1]}...{shards[-1:]} do not cover size {size}"
    if any(b <= a or b - a > shard_floats for a, b in shards):
        return f"a shard is empty or larger than shard_bytes {m['shard_bytes']}"
    if any(b0 != a1 for (_, b0), (a1, _) in zip(shards, shards[1:])):
        return "the shards are not contiguous"
    if not len(blocks) == len(shards) == len(versions):
        return f"{len(shards)} shards, {len(blocks)} blocks, {len(versions)} versions"
    for path in blocks:
        parts = str(path).split("/")
        if not isinstance(path, str) or parts[0] != BLOCKS or ".." in parts or "" in parts:
            return f"block path {path!r} is not inside the checkpoint"
    import psutil

    limit = psutil.virtual_memory().available * _MAX_BYTES_FRACTION
    if size * 4 > limit:
        return f"{size} parameters ({size * 4 / 1e9:.1f} GB) would not fit in memory here"
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

    def write(self, snap: Snapshot) -> str:
        """Write ``snap`` as a new block; returns its path. Raises on storage errors."""
        import zarr

        path = block_path(snap.shard, snap.gen, snap.version)
        arr = zarr.create_array(
            store=self._zarr(),
            name=path,
            shape=(snap.stop - snap.start,),
            chunks=(snap.stop - snap.start,),
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
            },
        )
        arr[:] = snap.values
        return path

    def read(self, path: str) -> tuple[np.ndarray, dict, tuple[tuple[int, int], ...]]:
        """(values, attributes, push ids) of the block at ``path``."""
        import zarr

        arr = zarr.open_array(store=self._zarr(), path=path, mode="r")
        listed = getattr(arr.metadata, "codecs", None)  # zarr v3 (ours); v2 is not
        codecs = {type(c).__name__.removesuffix("Codec").lower() for c in listed or ()}
        if listed is None or arr.dtype != np.float32 or arr.ndim != 1 or not codecs <= _CODECS:
            raise CheckpointError(
                f"block {path} is not a float32 vector stored with known codecs "
                f"({arr.dtype}, {arr.ndim} dims, codecs {sorted(codecs)})",
                "restore from a checkpoint this parameter server wrote",
            )
        attrs = dict(arr.attrs)
        ids = attrs.get("ids", "")
        if not isinstance(ids, str):
            raise TypeError(f"the push ids of block {path} are not a string: {ids!r}")
        return np.asarray(arr[:], dtype=np.float32), attrs, _decode_ids(ids)

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
            snap = Snapshot(sid, a, b, versions[sid], values[a:b], (), generation)
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


def read_checkpoint(url: str, storage_options: dict | None = None) -> tuple[dict, np.ndarray]:
    """(manifest, flat float32 values) of the last complete checkpoint at ``url``.

    A block replaced long enough ago may be deleted while this reads an older manifest: then
    the newer manifest is read again (a few times)."""
    for attempt in range(3):
        try:
            return _read_checkpoint(url, storage_options)
        except FileNotFoundError:
            if attempt == 2:
                raise CheckpointError(
                    f"the checkpoint at {normalize_url(url)} changed under three reads",
                    "retry when the parameter server writes less often",
                ) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _read_checkpoint(url: str, storage_options: dict | None) -> tuple[dict, np.ndarray]:
    import zarr

    m = read_manifest(url, storage_options)
    try:
        if int(m.get("format_version", 1)) < 2:
            g = zarr.open_group(store=zarr_store(url, storage_options, read_only=True), mode="r")
            params = g["params"]
            if not isinstance(params, zarr.Array):
                raise TypeError("params is a group, not an array")
            values = np.asarray(params[:], dtype=np.float32)
        else:
            reader = BlockStore(url, storage_options)
            values = np.zeros(int(m["size"]), np.float32)
            for sid, ((a, b), path) in enumerate(zip(m["shards"], m["blocks"])):
                block, attrs, _ = reader.read(path)
                if int(attrs["version"]) != int(m["versions"][sid]) or block.shape != (b - a,):
                    raise CheckpointError(f"block {path} does not match the manifest")
                values[a:b] = block
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"the checkpoint at {normalize_url(url)} has a manifest but its "
            f"data cannot be read: {exc}",
            "the checkpoint is damaged",
        ) from exc
    if values.shape != (int(m["size"]),):
        raise CheckpointError(
            f"the checkpoint at {normalize_url(url)} holds {values.shape[0]} "
            f"values, its manifest says {m['size']}",
            "the checkpoint is damaged",
        )
    return m, values
