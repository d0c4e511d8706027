"""Where ingest finds its data: MNIST-style IDX files and class folders, at any fsspec URL.

:func:`discover` turns a source URL into its splits (:class:`SplitSource`), :func:`parse_idx` /
:func:`read_idx` read IDX files, :func:`mnist_location` finds the four official MNIST files
(``$ADAM_DASK_MNIST``, a ``shared/datasets/mnist`` folder beside the checkout, or the public mirror)
and checks them against an ``MD5SUMS`` file when the folder has one. Nothing here writes.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import posixpath
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import config
from ..errors import SourceError
from ..storage import describe_storage_error, filesystem, join_url, normalize_url

__all__ = [
    "MNIST_FILES",
    "SplitSource",
    "discover",
    "mnist_location",
    "parse_idx",
    "read_idx",
]

logger = logging.getLogger(__name__)

IDX_DTYPES: dict[int, Any] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
_IDX_IMAGES = re.compile(r"^(?P<split>.+?)[-_.]images[-_.]idx3[-_.]ubyte(\.gz)?$")
_IDX_LABELS = "{split}-labels-idx1-ubyte"
_SPLIT_NAMES = {"train": "train", "t10k": "test", "test": "test"}


# -- IDX -------------------------------------------------------------------------------------------


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Decode the bytes of an IDX file (already decompressed) into an array."""
    if len(data) < 4:
        raise SourceError(
            f"{name} is too short to be an IDX file ({len(data)} bytes)",
            "check that the file is complete",
            path=name,
        )
    zero, type_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or type_code not in IDX_DTYPES or not 1 <= ndim <= 4:
        raise SourceError(
            f"{name} has the wrong IDX magic number 0x{data[:4].hex()}",
            "expected 0x00000801 (labels) or 0x00000803 (images); "
            "check that it is an MNIST-style IDX file",
            path=name,
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise SourceError(f"{name} ends inside its IDX header", "download it again", path=name)
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(IDX_DTYPES[type_code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    got = len(data) - header
    if got != expected:
        raise SourceError(
            f"{name} holds {got} data bytes but its header {tuple(shape)} needs {expected}",
            "the file is truncated or corrupt; download it again",
            path=name,
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def read_idx(url: str, storage_options: dict | None = None) -> np.ndarray:
    """Read an IDX file (raw or ``.gz``) from any fsspec URL."""
    fs, path = filesystem(url, storage_options)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError as exc:
        raise SourceError(f"{url} does not exist", "check the path", path=url) from exc
    except OSError as exc:
        raise describe_storage_error(url, exc) from exc
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise SourceError(
                f"{url} is a truncated or corrupt gzip file ({exc})", "download it again", path=url
            ) from exc
    return parse_idx(raw, url)


# -- source discovery --------------------------------------------------------------------------------

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def mnist_location() -> str:
    """Where the four MNIST files are: ``$ADAM_DASK_MNIST``, else a ``shared/datasets/mnist``
    folder beside the working directory or the source checkout, else the public mirror
    (``adam.data.mnist-mirror``)."""
    if os.environ.get("ADAM_DASK_MNIST"):
        return os.environ["ADAM_DASK_MNIST"]
    here = os.path.dirname(os.path.abspath(__file__))
    for base in (os.getcwd(), os.path.join(here, "..", "..")):
        cand = os.path.normpath(os.path.join(base, "..", "shared", "datasets", "mnist"))
        if all(
            os.path.exists(os.path.join(cand, f)) for pair in MNIST_FILES.values() for f in pair
        ):
            return cand
    return config.get("data.mnist-mirror")


def _verify_md5sums(src: str, splits: list[SplitSource], storage_options: dict | None) -> None:
    """Check the files against an ``MD5SUMS`` file in the source folder, when there is one."""
    fs, root = filesystem(src, storage_options)
    sums_path = posixpath.join(root, "MD5SUMS") if "://" in src else os.path.join(root, "MD5SUMS")
    try:
        text = fs.cat_file(sums_path).decode()
    except Exception:
        return
    expected = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            expected[parts[1].lstrip("*")] = parts[0].lower()
    for s in splits:
        for url in (s.images, s.labels):
            name = posixpath.basename(url)
            if name in expected:
                fs2, path = filesystem(url, storage_options)
                got = hashlib.md5(fs2.cat_file(path)).hexdigest()
                if got != expected[name]:
                    raise SourceError(
                        f"{url} has MD5 {got}, but MD5SUMS says {expected[name]}",
                        "the file is damaged; download it again",
                        path=url,
                    )


@dataclass
class SplitSource:
    """What one split of a source holds, before it is read."""

    name: str
    kind: str  # "idx" or "folder"
    images: str = ""  # idx: images file URL
    labels: str = ""  # idx: labels file URL
    files: list[str] = field(default_factory=list)  # folder: image file paths, in order
    file_labels: list[int] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)


def discover(src: str, storage_options: dict | None = None) -> list[SplitSource]:
    """Find the splits of an ingest source (IDX files or class folders).

    ``src="mnist"`` means the official MNIST files, found by :func:`mnist_location`.
    """
    if src == "mnist":
        src = mnist_location()
        if src.startswith(("http://", "https://")):  # a web mirror cannot be listed
            base = src.rstrip("/")
            return [
                SplitSource(name, "idx", images=f"{base}/{i}", labels=f"{base}/{l}")
                for name, (i, l) in MNIST_FILES.items()
            ]
    src = normalize_url(src)
    fs, root = filesystem(src, storage_options)
    try:
        if not fs.exists(root):
            raise SourceError(f"the source {src} does not exist", "check the path or URL", path=src)
        if not fs.isdir(root):
            raise SourceError(
                f"the source {src} is a file, not a folder",
                "give the folder holding the IDX files or the class folders",
                path=src,
            )
        entries = fs.ls(root, detail=True)
    except SourceError:
        raise
    except Exception as exc:  # botocore's connection errors are not OSErrors
        raise describe_storage_error(src, exc) from exc
    proto = src.split("://", 1)[0] + "://" if "://" in src else ""

    def url_of(p: str) -> str:
        return proto + p if proto and not p.startswith(proto) else p

    files = {posixpath.basename(e["name"].rstrip("/")): e for e in entries if e["type"] == "file"}
    dirs = sorted(
        posixpath.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory"
    )
    idx = {n: m for n in files if (m := _IDX_IMAGES.match(n))}
    if idx:
        splits = []
        for name, m in sorted(idx.items()):
            prefix, gz = m.group("split"), name.endswith(".gz")
            label_name = _IDX_LABELS.format(split=prefix) + (".gz" if gz else "")
            if label_name not in files:
                alt = _IDX_LABELS.format(split=prefix) + ("" if gz else ".gz")
                if alt not in files:
                    raise SourceError(
                        f"{name} in {src} has no labels file {label_name}",
                        "add the matching *-labels-idx1-ubyte file",
                        path=src,
                    )
                label_name = alt
            split = _SPLIT_NAMES.get(prefix.lower(), "train" if len(idx) == 1 else prefix.lower())
            splits.append(
                SplitSource(
                    split,
                    "idx",
                    images=url_of(files[name]["name"]),
                    labels=url_of(files[label_name]["name"]),
                )
            )
        _verify_md5sums(src, splits, storage_options)
        names = [s.name for s in splits]
        if len(set(names)) != len(names):
            raise SourceError(
                f"{src} holds several IDX image files for one split: {sorted(idx)}",
                "keep one pair per split",
                path=src,
            )
        return splits
    if not dirs:
        raise SourceError(
            f"the source {src} is empty: no IDX files and no class folders",
            "point at a folder of *-images-idx3-ubyte files or of class folders",
            path=src,
        )
    if set(dirs) >= {"train"} and set(dirs) <= {"train", "test"}:
        return [_folder_split(fs, url_of, join_url(root, d), d, src) for d in dirs]
    return [_folder_split(fs, url_of, root, "train", src)]


def _folder_split(fs, url_of: Callable[[str], str], root: str, split: str, src: str) -> SplitSource:
    classes = sorted(
        posixpath.basename(e["name"].rstrip("/"))
        for e in fs.ls(root, detail=True)
        if e["type"] == "directory"
    )
    if not classes:
        raise SourceError(
            f"{root} has no class folders", "put each class's images in a sub-folder", path=src
        )
    files, labels = [], []
    for c, cls in enumerate(classes):
        for p in sorted(fs.find(join_url(root, cls))):
            if posixpath.basename(p).startswith("."):
                continue
            files.append(url_of(p))
            labels.append(c)
    if not files:
        raise SourceError(f"the class folders of {root} hold no files", "add images", path=src)
    return SplitSource(split, "folder", files=files, file_labels=labels, classes=classes)
