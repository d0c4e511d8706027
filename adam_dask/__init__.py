"""adam_dask: Project Adam (Chilimbi et al., OSDI 2014) on Dask."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import config  # noqa: F401  (registers the defaults with dask.config)
from . import cluster, errors
from .errors import AdamError

try:
    __version__ = version("adam_dask")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = ["AdamError", "__version__", "cluster", "config", "errors"]
