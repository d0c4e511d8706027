"""What a replica asks of a network, for both engines, and the parts of it they share.

The numba :class:`~adam_dask.model.network.Network` and the PyTorch
:class:`~adam_dask.model.torch_engine.TorchNetwork` implement one protocol (docs/design.md, "Two
engines, one flat buffer"). This module names it in types the engines' helpers are written
against, so that a helper (a work-buffer :class:`~adam_dask.model.context.Context`, the fused
step in :mod:`adam_dask.model.fused`) needs no import of the engine it serves, and holds what
both engines do alike: the ``flat`` attribute (:class:`FlatBuffer`), the ``repr``
(:func:`describe`), ``predict`` and ``evaluate`` (:func:`predict`, :func:`accuracy`).

>>> from adam_dask.model import Network
>>> net = Network.from_spec("fc5,fc3", (1, 2, 2), "relu", seed=0)
>>> describe(net, activation=net.activation)
"Network('fc5,fc3', input_shape=(1, 2, 2), activation='relu', 43 parameters)"
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, overload

import numpy as np

from .layout import ParameterLayout, assign_flat
from .spec import Layer

logger = logging.getLogger(__name__)

__all__ = [
    "Classifier",
    "FlatBuffer",
    "NetworkPlan",
    "Trainable",
    "accuracy",
    "describe",
    "predict",
]


class NetworkPlan(Protocol):
    """What a numba :class:`~adam_dask.model.context.Context` is built from: a parsed spec
    (``layers``) with its parameters' ``layout`` (a ``Network``, or anything shaped like one)."""

    @property
    def spec(self) -> str: ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def layers(self) -> list[Layer]: ...

    @property
    def layout(self) -> ParameterLayout: ...

    @property
    def classes(self) -> int: ...


class Trainable(NetworkPlan, Protocol):
    """What the fused step (:func:`adam_dask.model.fused.step`) reads of a network: its plan,
    its weights and its training options."""

    @property
    def flat(self) -> np.ndarray: ...

    @property
    def dropout(self) -> float: ...

    @property
    def label_smoothing(self) -> float: ...


class Classifier(Protocol):
    """Either engine as :func:`predict` and :func:`accuracy` use it."""

    def forward(self, x: Any, batch_size: int = 256) -> np.ndarray: ...

    def as_images(self, x: Any) -> np.ndarray: ...

    def check_labels(self, y: Any, n: int) -> np.ndarray: ...


class _FlatOwner(Protocol):
    _flat: np.ndarray

    def weights_assigned(self) -> None: ...


class FlatBuffer:
    """The ``flat`` attribute of both engines: every parameter in one float32 buffer (the
    owner's ``_flat``, which its parameters view). Assigning copies the values in
    (:func:`~adam_dask.model.layout.assign_flat`: shapes checked, the views stay valid) and then
    calls the owner's ``weights_assigned()``, which drops what described the old weights (the
    numba engine's population statistics, the torch engine's calibration)."""

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> FlatBuffer: ...

    @overload
    def __get__(self, obj: _FlatOwner, owner: type | None = None) -> np.ndarray: ...

    def __get__(self, obj: _FlatOwner | None, owner: type | None = None) -> Any:
        return self if obj is None else obj._flat

    def __set__(self, obj: _FlatOwner, values: np.ndarray) -> None:
        assign_flat(obj._flat, values)
        obj.weights_assigned()


def describe(net: Any, **fields: Any) -> str:
    """Both engines' ``repr``: ``Kind('spec', input_shape=(C, H, W), <fields>, N parameters)``."""
    extra = "".join(f"{k}={v!r}, " for k, v in fields.items())
    return (
        f"{type(net).__name__}({net.spec!r}, input_shape={net.input_shape}, "
        f"{extra}{net.layout.size} parameters)"
    )


def predict(net: Classifier, x: Any, batch_size: int = 256) -> np.ndarray:
    """Class labels (B,) int64 of images ``x`` (any form ``net.as_images`` accepts)."""
    return net.forward(net.as_images(x), batch_size).argmax(axis=1)


def accuracy(net: Classifier, x: Any, y: Any, batch_size: int = 256) -> float:
    """Accuracy in [0, 1] of ``net`` on images ``x`` (any form ``net.as_images`` accepts) with
    labels ``y`` (N,)."""
    x = net.as_images(x)
    y = net.check_labels(y, x.shape[0])
    return float((predict(net, x, batch_size) == y).mean())
