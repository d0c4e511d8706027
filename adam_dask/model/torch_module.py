"""A user's PyTorch module made ready for the torch engine
(:class:`~adam_dask.model.torch_engine.TorchNetwork`): built from what ``model=`` names (a
factory path, a zero-argument callable), checked (on the CPU, floating-point parameters, in
float32), its parameters bound as views of a flat buffer; and the small helpers the engine
reads a module with.

This is where the engine imports torch, so that a missing torch is one
:class:`~adam_dask.errors.ModelSpecError` saying what to install (``torch_engine`` imports
``torch`` and ``nn`` from here).

>>> m = build_module(lambda: torch.nn.Linear(4, 2), seed=0, what="a lambda")
>>> describe_module(m), loss_name(None)
('torch.nn.modules.linear.Linear', 'cross_entropy')
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ModelSpecError
from ._factory_path import is_factory_path
from .layout import ParameterLayout

try:
    import torch
    from torch import nn
except ImportError as exc:  # pragma: no cover - the optional extra is missing
    raise ModelSpecError(
        f"a PyTorch model needs torch ({exc})", 'pip install "adam_dask[torch]"'
    ) from None

logger = logging.getLogger(__name__)

__all__ = [
    "as_float32",
    "bind",
    "build_module",
    "describe_module",
    "is_bn",
    "load_factory",
    "loss_name",
    "nn",
    "tensor",
    "torch",
]


def load_factory(path: str) -> Callable[[], Any]:
    """The callable that ``"package.module:name"`` names (``name`` may be dotted), or one
    :class:`ModelSpecError` saying what to fix."""
    if not is_factory_path(path):
        raise ModelSpecError(
            f"{path!r} is not a model factory path",
            "write it as package.module:factory (a zero-argument callable returning an nn.Module)",
        )
    mod_name, _, attr = path.strip().partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ModelSpecError(
            f"cannot import {mod_name!r} for the model factory {path!r}: {exc}",
            "install the package (or put it on PYTHONPATH) on the client and every TRAIN worker",
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelSpecError(
                f"{mod_name!r} has no {attr!r} (model factory {path!r})",
                "name a zero-argument callable that returns an nn.Module",
            ) from None
    if not callable(obj):
        raise ModelSpecError(f"the model factory {path!r} is not callable")
    return obj


def build_module(factory: Callable[[], Any], seed: int | None, what: str) -> nn.Module:
    """``factory()`` (with torch's generator seeded from ``seed`` when given, restored after)
    checked to be an ``nn.Module``."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(int(seed))
        module = factory()
    if not isinstance(module, nn.Module):
        raise ModelSpecError(
            f"the model factory {what} returned {type(module).__name__}, not an nn.Module",
            "return the module from a zero-argument callable",
        )
    return module


def as_float32(module: nn.Module) -> nn.Module:
    """``module`` in float32 (the parameter server holds float32 values), refused when a
    parameter is not on the CPU: the engine trains on the CPU (each parameter is a view of the
    numpy buffer the server shards), and moving a CUDA module there without a word would train
    it far from where its author meant it to run."""
    for name, p in module.named_parameters():
        if p.device.type != "cpu":
            raise ModelSpecError(
                f"parameter {name!r} is on {p.device}; adam_dask's torch engine trains on the CPU "
                "(its parameters are views of the parameter server's numpy buffer)",
                "build the module on the CPU (drop .cuda() / .to(device) from the factory)",
            )
        if not p.is_floating_point():
            raise ModelSpecError(
                f"parameter {name!r} is {p.dtype}; the parameter server holds float32 values",
                "keep integer tensors in buffers, not parameters",
            )
    if any(p.dtype != torch.float32 for p in module.parameters()):
        module = module.to(torch.float32)
    return module


def bind(module: nn.Module, layout: ParameterLayout, flat: np.ndarray, grad=None) -> None:
    """Make every parameter of ``module`` a view into ``flat`` (and its ``.grad`` a view into
    ``grad`` when given)."""
    params = dict(module.named_parameters())
    for e in layout:
        p = params[e.name]
        p.data = torch.from_numpy(flat[e.offset : e.offset + e.size]).view(e.shape)
        if grad is not None:
            p.grad = torch.from_numpy(grad[e.offset : e.offset + e.size]).view(e.shape)


def describe_module(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def loss_name(loss: Callable | None) -> str:
    if loss is None:
        return "cross_entropy"
    return getattr(loss, "__qualname__", None) or type(loss).__qualname__


def tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor sharing its memory (a copy when it is read-only, which
    ``torch.from_numpy`` warns about)."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def is_bn(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
