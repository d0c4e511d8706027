"""Which engine trains a model: the numba :class:`~adam_dask.model.network.Network` (a spec
string, the default and the fast path for the paper's layers) or the PyTorch
:class:`~adam_dask.model.torch_engine.TorchNetwork` (any ``nn.Module``, a zero-argument callable
returning one, or a ``"package.module:factory"`` path). Both hold their parameters in one flat
float32 buffer with a :class:`~adam_dask.model.layout.ParameterLayout`, so the replicas, the
parameter server and the checkpoints treat them alike; this module dispatches between them
without importing torch unless a torch model is asked for.

>>> is_factory_path("mypkg.models:resnet"), is_factory_path("conv5x5:10,maxpool2,fc10")
(True, False)
"""

from __future__ import annotations

import logging
from typing import Any

from ._factory_path import TORCH, is_factory_path

logger = logging.getLogger(__name__)

__all__ = [
    "TORCH",
    "is_factory_path",
    "is_torch_model",
    "load",
    "network_from_dict",
    "read_network",
    "shipped",
]


def is_torch_model(model: Any) -> bool:
    """Whether ``model`` (a Trainer's ``model=``) asks for the PyTorch engine: an
    ``nn.Module``, a zero-argument callable returning one, a factory path, or a
    :class:`TorchNetwork`. ``None``, a spec string and a numba ``Network`` do not."""
    from .network import Network

    if model is None or isinstance(model, Network):
        return False
    if isinstance(model, str):
        return is_factory_path(model)
    return getattr(model, "engine", None) == TORCH or callable(model)


def network_from_dict(d: dict, seed: int = 0, model: Any = None) -> Any:
    """The network a ``to_dict()`` (a checkpoint manifest's or a replica job's) describes:
    a numba ``Network`` freshly initialised from ``seed``, or a ``TorchNetwork`` rebuilt from
    its factory, its shipped module, or ``model`` (an ``nn.Module`` or factory for a run that
    trained a module object); the weights come from the parameter server or checkpoint."""
    if d.get("engine") == TORCH:
        from .torch_engine import TorchNetwork

        return TorchNetwork.from_dict(d, model=model)
    from .network import Network

    return Network.from_dict(d, seed=seed)


def shipped(net: Any) -> dict:
    """What a replica job carries to the TRAIN workers to rebuild ``net``: its ``to_dict()``,
    plus, for a torch module with no factory path, the module itself (cloudpickled; never
    stored in a checkpoint)."""
    job = getattr(net, "job_dict", None)
    return job() if job is not None else net.to_dict()


def read_network(
    url: str, model: Any = None, storage_options: dict | None = None
) -> tuple[dict, Any]:
    """(manifest, network) of the checkpoint at ``url``: the network its manifest describes
    (either engine, as :func:`network_from_dict`; ``model`` for a run that trained a module
    object) holding the checkpoint's weights."""
    from ..checkpoint_io import read_model

    manifest, d, values = read_model(url, storage_options)
    net = network_from_dict(d, model=model)
    net.flat = values
    return manifest, net


def load(url: str, model: Any = None, storage_options: dict | None = None) -> Any:
    """The trained network of the checkpoint (a run folder) at ``url``, for either engine: a
    numba :class:`~adam_dask.model.network.Network` or a
    :class:`~adam_dask.model.torch_engine.TorchNetwork` (its module rebuilt from the factory
    path the run trained; ``model``, an ``nn.Module`` or factory, for a run that trained a
    module object), holding the checkpoint's weights. No cluster is needed, and no pickle is
    read. A network with batch norm needs ``calibrate(training images)`` before inference (its
    running statistics are not stored)::

        net = adam_dask.load("runs/20261126-101500-ab12cd")
        net.evaluate(x_test, y_test)
    """
    return read_network(url, model=model, storage_options=storage_options)[1]
