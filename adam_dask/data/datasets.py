"""Open and validate dataset stores written by ``adam-dask ingest``.

A store holds one Zarr v3 group per split (``train``, ``test``). Each split group has arrays
``images`` (N, H, W) or (N, H, W, C) uint8 and ``labels`` (N,), and attributes ``classes``,
``source``, ``sha256`` and ``complete``. ``complete`` is written last by ingest: a split without
it was interrupted and is refused, so a reader never trains on half a dataset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from ..errors import DatasetError
from ..storage import normalize_url, zarr_store

logger = logging.getLogger(__name__)

__all__ = ["SPLITS", "Split", "describe", "load_arrays", "open_split"]

SPLITS = ("train", "test")


@dataclass
class Split:
    """One validated split of a dataset store; arrays are lazy Zarr arrays."""

    url: str
    name: str
    images: Any  # zarr.Array (N, H, W[, C]) uint8
    labels: Any  # zarr.Array (N,)
    classes: list[str]
    attrs: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def image_shape(self) -> tuple[int, ...]:
        """(H, W) or (H, W, C)."""
        return tuple(int(d) for d in self.images.shape[1:])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The model's input shape (C, H, W)."""
        s = self.image_shape
        return (1, s[0], s[1]) if len(s) == 2 else (s[2], s[0], s[1])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def chunk_images(self) -> int:
        return int(self.images.chunks[0])

    def read(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Images and labels ``[start:stop]`` as numpy arrays; a clear error on a bad chunk."""
        stop = len(self) if stop is None else stop
        try:
            return np.asarray(self.images[start:stop]), np.asarray(self.labels[start:stop])
        except Exception as exc:
            raise DatasetError(
                f"cannot read images {start}:{stop} of {self.url}/{self.name}: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "the store is damaged; ingest it again",
                url=self.url,
            ) from exc


def open_split(url: str, split: str = "train", storage_options: dict | None = None) -> Split:
    """Open and validate split ``split`` of the dataset store at ``url``."""
    url = normalize_url(url)
    where = f"{url}/{split}"
    try:
        store = zarr_store(url, storage_options, read_only=True)
        root = zarr.open_group(store=store, mode="r", zarr_format=3)
    except FileNotFoundError as exc:
        raise DatasetError(
            f"no dataset store at {url}",
            "check the URL, or create one with `adam-dask ingest SRC DEST`",
            url=url,
        ) from exc
    except Exception as exc:
        raise DatasetError(
            f"cannot open the dataset store at {url}: {type(exc).__name__}: {exc}",
            "check the URL and --storage-options",
            url=url,
        ) from exc
    if split not in root:
        raise DatasetError(
            f"the dataset store at {url} has no {split!r} split "
            f"(it has {sorted(k for k in root.group_keys())})",
            "ingest the split or choose another",
            url=url,
        )
    g: Any = root[split]  # a zarr.Group (checked below through its arrays)
    for name in ("images", "labels"):
        if name not in g:
            raise DatasetError(
                f"{where} has no {name!r} array",
                "it was not written by `adam-dask ingest`; ingest it again",
                url=url,
            )
    images: Any = g["images"]
    labels: Any = g["labels"]
    attrs: dict[str, Any] = dict(g.attrs)
    if not attrs.get("complete"):
        raise DatasetError(
            f"{where} is incomplete (its ingest was interrupted)",
            "run `adam-dask ingest ... --overwrite` again",
            url=url,
        )
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise DatasetError(
            f"{where}/images is {images.dtype} {images.shape}, expected uint8 "
            "(N, H, W) or (N, H, W, C)",
            "ingest the data again",
            url=url,
        )
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise DatasetError(
            f"{where} has {images.shape[0]} images but labels of shape {labels.shape}",
            "ingest the data again",
            url=url,
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(
            f"{where}/labels is {labels.dtype}, expected integers", "ingest the data again", url=url
        )
    classes = [str(c) for c in attrs.get("classes", [])]
    if not classes:
        raise DatasetError(f"{where} has no 'classes' attribute", "ingest the data again", url=url)
    return Split(url=url, name=split, images=images, labels=labels, classes=classes, attrs=attrs)


def load_arrays(
    url: str,
    split: str = "test",
    storage_options: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All of split ``split`` in memory: (images uint8 (N, H, W[, C]), labels int64 (N,)).

    For evaluation; :func:`adam_dask.data.augment.to_float` turns the images into the model's
    (N, C, H, W) float32 input. Errors name the store.
    """
    s = open_split(url, split, storage_options)
    images, labels = s.read(0, len(s))
    return images, labels.astype(np.int64)


def describe(url: str, storage_options: dict | None = None) -> dict:
    """A JSON-safe description of a dataset store: splits, shapes, classes, chunking, bytes."""
    url = normalize_url(url)
    try:
        root = zarr.open_group(store=zarr_store(url, storage_options), mode="r", zarr_format=3)
    except FileNotFoundError as exc:
        raise DatasetError(
            f"no dataset store at {url}",
            "check the URL, or create one with `adam-dask ingest SRC DEST`",
        ) from exc
    out: dict[str, Any] = {"url": url, "splits": {}}
    for name in sorted(root.group_keys()):
        s = open_split(url, name, storage_options)
        out["splits"][name] = {
            "images": len(s),
            "image_shape": list(s.image_shape),
            "classes": s.classes,
            "chunk_images": s.chunk_images,
            "shard_images": int(s.images.shards[0]) if getattr(s.images, "shards", None) else None,
            "nbytes": int(s.images.nbytes + s.labels.nbytes),
            "nbytes_stored": int(s.images.nbytes_stored() + s.labels.nbytes_stored()),
            "sha256": s.attrs.get("sha256"),
            "source": s.attrs.get("source"),
        }
    return out
