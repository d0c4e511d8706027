"""adam_dask: Project Adam (Chilimbi et al., OSDI 2014) on Dask.

The heavy parts (numba kernels, the parameter server, the trainer) load on first use, so
``import adam_dask`` and the CLI start fast::

    import adam_dask
    with adam_dask.cluster.local() as client:
        trainer = adam_dask.Trainer("data/mnist.zarr", client=client)
        trainer.fit(epochs=3)
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

from . import (
    cluster,
    config,
    errors,
)
from .errors import AdamError

try:
    __version__ = version("adam_dask")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

_LAZY = {
    "Trainer": ("adam_dask.train.trainer", "Trainer"),
    "ParameterServer": ("adam_dask.ps.server", "ParameterServer"),
    "Network": ("adam_dask.model.network", "Network"),
    "DataService": ("adam_dask.data.serving", "DataService"),
    "Augment": ("adam_dask.data.augment", "Augment"),
    "ingest": ("adam_dask.data.ingest", "ingest"),
}
_SUBMODULES = ("data", "model", "ps", "train")

__all__ = [
    "AdamError",
    "Augment",
    "DataService",
    "Network",
    "ParameterServer",
    "Trainer",
    "__version__",
    "cluster",
    "config",
    "errors",
    "ingest",
    *_SUBMODULES,
]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'adam_dask' has no attribute {name!r}")
