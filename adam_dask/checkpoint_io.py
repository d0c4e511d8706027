"""Reading a checkpoint back: its manifest and its values, checked before they are trusted.

The parameter server writes checkpoints (:mod:`adam_dask.ps.checkpoint`, where the format is
described); restoring a server, loading a trained model back (:func:`adam_dask.load`, for
either engine) and ``adam-dask evaluate`` read them through this module, which sits below both
the model and the parameter server, so neither imports the other to read one. A manifest and
its blocks may come from a place that is not ours to trust: everything a manifest names is
checked before a byte is allocated for it or a path is opened, and no pickle is ever read.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import numpy as np

from .errors import CheckpointError
from .storage import filesystem, join_url, normalize_url, zarr_store

logger = logging.getLogger(__name__)

__all__ = [
    "BLOCKS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "manifest_problem",
    "read_block",
    "read_checkpoint",
    "read_manifest",
    "read_model",
    "split_block",
]

MANIFEST = "manifest.json"
FORMAT = "adam-ps-checkpoint"
FORMAT_VERSION = 2
BLOCKS = "shards"


def _decode_ids(text: str) -> tuple[tuple[int, int], ...]:
    a = np.frombuffer(base64.b64decode(text), dtype="<i8").reshape(-1, 2)
    return tuple((int(v), int(p)) for v, p in a)


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


def read_block(store: Any, path: str) -> tuple[np.ndarray, dict, tuple[tuple[int, int], ...]]:
    """(values, attributes, push ids) of the block at ``path`` in the Zarr ``store``: a float32
    vector stored with codecs that execute no code, or :class:`CheckpointError`."""
    import zarr

    arr = zarr.open_array(store=store, path=path, mode="r")
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


def split_block(block: np.ndarray, attrs: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, the server optimizer's state or None) of a block read by :func:`read_block`:
    a block of a shard with momentum holds the values, then the momentum (``state_vectors``)."""
    n = int(attrs["stop"]) - int(attrs["start"])
    k = int(attrs.get("state_vectors", 0))
    if block.shape != ((1 + k) * n,):
        raise CheckpointError(
            f"a block of shard {attrs.get('shard')} holds {block.shape[0]} floats, "
            f"expected {(1 + k) * n}",
            "restore from a checkpoint this parameter server wrote",
        )
    return block[:n], (block[n : 2 * n] if k else None)


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
            store = zarr_store(url, storage_options, read_only=True)
            values = np.zeros(int(m["size"]), np.float32)
            for sid, ((a, b), path) in enumerate(zip(m["shards"], m["blocks"])):
                full, attrs, _ = read_block(store, path)
                if int(attrs["stop"]) - int(attrs["start"]) != b - a:
                    raise CheckpointError(f"block {path} does not match the manifest")
                block, _ = split_block(full, attrs)
                if int(attrs["version"]) != int(m["versions"][sid]):
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


def read_model(url: str, storage_options: dict | None = None) -> tuple[dict, dict, np.ndarray]:
    """(manifest, the model's description, flat values) of the checkpoint a training run wrote
    at ``url``; :class:`CheckpointError` when its manifest describes no model."""
    manifest, values = read_checkpoint(url, storage_options)
    d = (manifest.get("meta") or {}).get("model")
    if not isinstance(d, dict) or not d:
        raise CheckpointError(
            f"the checkpoint at {normalize_url(url)} names no model",
            "it was not written by a training run (adam-dask train, Trainer); "
            "read its values with adam_dask.ps.checkpoint.read_checkpoint",
        )
    return manifest, d, values
