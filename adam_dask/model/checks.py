"""The checks of what a caller hands either engine: images, labels, and a training step's
arguments. Both engines call these functions, so a bad argument is refused by both with the
same one line (``tests/model/test_engine_checks.py``).

>>> check_input(np.zeros((2, 1, 4, 4)), (1, 4, 4)).dtype.name
'float32'
>>> check_labels([3, 1], 2, classes=3)
Traceback (most recent call last):
...
adam_dask.errors.InputShapeError: labels must lie in [0, 3), got [1, 3]
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from ..errors import InputShapeError, ModelSpecError

logger = logging.getLogger(__name__)

__all__ = ["as_images", "check_input", "check_labels", "check_step", "image_shape"]

_NO_ACC = np.zeros(0, np.float32)


class _Context(Protocol):
    batch_size: int
    network_id: int
    spec: str
    input_shape: tuple[int, ...]


class _Network(Protocol):
    @property
    def spec(self) -> str: ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def flat(self) -> np.ndarray: ...


def image_shape(input_shape: Any) -> tuple[int, ...]:
    """``input_shape`` as (C, H, W) ints ((H, W) gets one channel), or :class:`ModelSpecError`."""
    shape = tuple(int(d) for d in input_shape)
    if len(shape) == 2:
        shape = (1, *shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ModelSpecError(f"input_shape must be (C, H, W) with positive sizes, got {shape}")
    return shape


def check_input(x: Any, input_shape: tuple[int, ...]) -> np.ndarray:
    """``x`` as a C-contiguous float32 (B, *input_shape) array, or :class:`InputShapeError`."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim != 4 or tuple(x.shape[1:]) != input_shape:
        raise InputShapeError(
            f"expected images of shape (B, {', '.join(map(str, input_shape))}), got {x.shape}",
            "add the batch and channel axes, e.g. x[:, None]",
        )
    if x.shape[0] == 0:
        raise InputShapeError("got an empty batch (0 images)")
    if x.dtype != np.float32:
        if not np.issubdtype(x.dtype, np.floating):
            raise InputShapeError(
                f"expected float32 images, got dtype {x.dtype}",
                "scale uint8 images to [0, 1] first (x / 255) or use "
                "evaluate(), which accepts uint8",
            )
        x = x.astype(np.float32)
    return np.ascontiguousarray(x)


def check_labels(y: Any, n: int, classes: int) -> np.ndarray:
    """``y`` as int64 (n,) within [0, classes), or :class:`InputShapeError`."""
    y = np.asarray(y)
    if y.shape != (n,):
        raise InputShapeError(f"expected {n} labels of shape ({n},), got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise InputShapeError(f"expected integer labels, got dtype {y.dtype}")
    if n and (y.min() < 0 or y.max() >= classes):
        raise InputShapeError(f"labels must lie in [0, {classes}), got [{y.min()}, {y.max()}]")
    return np.ascontiguousarray(y, dtype=np.int64)


def as_images(x: Any, input_shape: tuple[int, ...]) -> np.ndarray:
    """Images of any common form as float32 (N, C, H, W): uint8 (N, H, W) / (N, H, W, C) /
    (N, C, H, W) scaled by 1/255, or float arrays as they are."""
    x = np.asarray(x)
    c, h, w = input_shape
    if x.ndim == 3 and c == 1 and x.shape[1:] == (h, w):
        x = x[:, None]
    elif x.ndim == 4 and x.shape[1:] == (h, w, c) and x.shape[1:] != (c, h, w):
        x = x.transpose(0, 3, 1, 2)
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / np.float32(255.0)
    return check_input(x, input_shape)


def check_step(
    net: _Network,
    ctx: _Context,
    x: np.ndarray,
    y: np.ndarray,
    n: int | None,
    momentum: float,
    velocity: np.ndarray,
    acc: np.ndarray | None,
) -> tuple[int, np.ndarray]:
    """The arguments of either engine's ``step_into`` checked for what would corrupt memory
    (the kernels check nothing): ``(n, acc)`` with ``n`` the images of the step (all of ``x``
    when None) and ``acc`` an empty array when None, or one :class:`InputShapeError`.

    ``ctx`` must be one this network made (``net.context``): the same object and the same
    plan; with momentum, ``velocity`` is like ``flat``; ``acc`` is float32 like ``flat``."""
    n = x.shape[0] if n is None else n
    if not 0 < n <= min(ctx.batch_size, x.shape[0], y.shape[0]):
        raise InputShapeError(
            f"a step of {n} images needs n <= the context's batch size "
            f"({ctx.batch_size}) and the {x.shape[0]} images and {y.shape[0]} labels given"
        )
    if (
        getattr(ctx, "network_id", None) != id(net)
        or ctx.spec != net.spec
        or ctx.input_shape != net.input_shape
    ):
        raise InputShapeError(
            f"{ctx!r} was made for another network", "make it with net.context(batch_size)"
        )
    flat = net.flat
    if momentum > 0 and velocity.shape[0] != flat.shape[0]:
        raise InputShapeError(
            f"momentum {momentum} needs a velocity of {flat.shape[0]} values, "
            f"got {velocity.shape[0]}"
        )
    if acc is None:
        return n, _NO_ACC
    if acc.shape != flat.shape or acc.dtype != np.float32:
        raise InputShapeError(
            f"an accumulator must be float32 like net.flat ({flat.shape[0]} values), "
            f"got {acc.dtype} {acc.shape}"
        )
    return n, acc
