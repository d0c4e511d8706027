"""adam_dask: Project Adam (Chilimbi et al., OSDI 2014) on Dask.

Asynchronous data-parallel training with a replicated parameter server::

    import adam_dask

    with adam_dask.cluster.local() as client:
        trainer = adam_dask.Trainer("data/mnist.zarr", client=client)
        trainer.fit(epochs=3)
    net = adam_dask.load(trainer.checkpoint)  # the trained network, either engine, no cluster

The public names are listed in ``__all__``; the subpackages (``data``, ``model``, ``ps``,
``train``) export what their users call, and everything in a module whose name starts with an
underscore is private. ``adam_dask.testing`` holds helpers for tests, notebooks and benchmarks
(synthetic stores, faults sent from outside) and is imported on demand.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import (
    cluster,
    config,  # registers the defaults (adam.yaml) with dask.config
    data,
    errors,
    model,
    ps,
    train,
)
from .data.augment import Augment
from .data.ingest import ingest
from .data.serving import DataService
from .errors import AdamError
from .model.engines import load
from .model.network import Network
from .ps.client.server import ParameterServer
from .train.metrics import History
from .train.trainer import Trainer

try:
    __version__ = version("adam_dask")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "AdamError",
    "Augment",
    "DataService",
    "History",
    "Network",
    "ParameterServer",
    "Trainer",
    "__version__",
    "cluster",
    "config",
    "data",
    "errors",
    "ingest",
    "load",
    "model",
    "ps",
    "train",
]
