"""Helpers shared by the benchmark scripts: where MNIST is, and a ready MNIST store."""
from __future__ import annotations

import os
import tempfile

from adam_dask.data.ingest import mnist_location


def mnist_folder() -> str:
    """The folder of the four official MNIST files ($ADAM_DASK_MNIST, shared/, or the mirror)."""
    return mnist_location()


def mnist_store(path: str | None = None) -> str:
    """A Zarr store of real MNIST, ingested once into a temporary folder (or ``path``)."""
    from adam_dask.data.datasets import open_split
    from adam_dask.data.ingest import ingest
    from adam_dask.errors import DatasetError

    path = path or os.path.join(tempfile.gettempdir(), "adam-dask-bench-mnist.zarr")
    try:
        open_split(path, "train")
        open_split(path, "test")
    except DatasetError:
        ingest("mnist", path, overwrite=True)
    return path
