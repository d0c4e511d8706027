"""The network spec: a string of layers parsed into a plan of :class:`Layer` (pure, no numba).

Spec grammar, layers separated by commas; a layer's index is its position in the list:

* ``conv<KH>x<KW>:<OC>`` (or ``conv<K>:<OC>``): valid 2-D convolution, stride 1, ``OC`` filters;
  parameters ``<i>.weight`` (OC, C, KH, KW) and ``<i>.bias`` (OC,), torch's ``nn.Conv2d`` layout.
* ``maxpool2``: 2x2 max-pooling, stride 2 (odd edges dropped, as torch's default). No parameters.
* ``fc<O>``: dense layer, ``<i>.weight`` (O, I) and ``<i>.bias`` (O,), torch's ``nn.Linear``
  layout; a convolutional input is flattened in (C, H, W) order, as ``torch.flatten``.
* ``bn``: batch normalisation of the conv or fc layer just before it, per channel (torch's
  ``nn.BatchNorm2d`` / ``nn.BatchNorm1d``, affine): ``<i>.weight`` (C,) scales and
  ``<i>.bias`` (C,) shifts. Training normalises by the mini-batch's statistics; inference by
  the population statistics that ``Network.calibrate`` recomputes from training images. Not
  one of the paper's layers: a named option (``conv5x5:10,bn,maxpool2,...``).

Every conv and fc layer is followed by the activation (``tanh`` or ``relu``), except the last
layer, which must be fc and gives the logits. Weights therefore move to and from a torch
``nn.Sequential`` of the same layers by name (see ``benchmarks/engine.py``).

The activation goes after a layer's batch normalisation, and a conv layer followed by
max-pooling applies its activation *after* the pooling: tanh and relu are monotonic, so
``pool(act(z)) == act(pool(z))`` exactly, and the activation then runs on a quarter of the values.

>>> [(L.kind, L.out_shape) for L in parse_spec("conv5x5:10,maxpool2,fc10", (1, 28, 28), "relu")]
[('conv', (10, 24, 24)), ('maxpool', (10, 12, 12)), ('fc', (10,))]
>>> [(L.kind, L.act) for L in parse_spec("conv5x5:10,bn,maxpool2,fc10", (1, 28, 28), "relu")]
[('conv', None), ('bn', None), ('maxpool', 'relu'), ('fc', None)]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import ModelSpecError

__all__ = ["ACTIVATIONS", "Layer", "parse_spec"]

ACTIVATIONS = ("tanh", "relu")
_CONV = re.compile(r"^conv(\d+)(?:x(\d+))?:(\d+)$")
_POOL = re.compile(r"^maxpool(\d+)$")
_FC = re.compile(r"^fc(\d+)$")
_NORMALISED = ("conv", "fc")  # what a bn layer may follow


@dataclass(slots=True)
class Layer:
    """One layer of the plan; shapes are per image (no batch axis)."""

    index: int
    kind: str  # "conv", "maxpool", "fc" or "bn"
    token: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    kernel: tuple[int, int] = (0, 0)
    act: str | None = None  # activation applied to this layer's output

    @property
    def has_params(self) -> bool:
        return self.kind != "maxpool"

    @property
    def in_size(self) -> int:
        return int(np.prod(self.in_shape))


def _image_shape(shape: tuple[int, ...], what: str, kind: str, i: int) -> tuple[int, int, int]:
    """``shape`` as (C, H, W), or the error that layer ``i`` (``what`` needs) has no image input."""
    if len(shape) != 3:
        raise ModelSpecError(
            f"{what} needs a (C, H, W) input, got {shape}",
            f"put {kind} layers before fc layers",
            layer=i,
        )
    c, h, w = shape
    return c, h, w


def parse_spec(spec: str, input_shape: tuple[int, ...], activation: str) -> list[Layer]:
    """The layer plan of ``spec`` on images of ``input_shape`` (C, H, W); raises
    :class:`ModelSpecError` naming the layer that does not parse or does not fit."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(
            f"empty network spec {spec!r}", "give layers such as 'conv5x5:10,maxpool2,fc10'"
        )
    tokens = [t.strip().lower() for t in spec.split(",")]
    shape = tuple(int(d) for d in input_shape)
    layers: list[Layer] = []
    for i, tok in enumerate(tokens):
        where = f"layer {i} ({tok!r}) of spec {spec!r}"
        if m := _CONV.match(tok):
            kh, kw, oc = int(m[1]), int(m[2] or m[1]), int(m[3])
            c, h, w = _image_shape(shape, f"{where}: a convolution", "conv", i)
            if kh < 1 or kw < 1 or oc < 1:
                raise ModelSpecError(f"{where}: kernel size and filters must be positive", layer=i)
            if kh > h or kw > w:
                raise ModelSpecError(
                    f"{where}: a {kh}x{kw} kernel does not fit a {h}x{w} input",
                    "use a smaller kernel or fewer pooling layers",
                    layer=i,
                )
            layers.append(Layer(i, "conv", tok, shape, (oc, h - kh + 1, w - kw + 1), (kh, kw)))
        elif m := _POOL.match(tok):
            if int(m[1]) != 2:
                raise ModelSpecError(
                    f"{where}: only 2x2 max-pooling is supported", "write 'maxpool2'", layer=i
                )
            c, h, w = _image_shape(shape, f"{where}: pooling", "pooling", i)
            if h < 2 or w < 2:
                raise ModelSpecError(f"{where}: cannot pool a {h}x{w} input", layer=i)
            layers.append(Layer(i, "maxpool", tok, shape, (c, h // 2, w // 2), (2, 2)))
        elif m := _FC.match(tok):
            o = int(m[1])
            if o < 1:
                raise ModelSpecError(f"{where}: a dense layer needs at least one output", layer=i)
            layers.append(Layer(i, "fc", tok, shape, (o,)))
        elif tok == "bn":
            if not layers or layers[-1].kind not in _NORMALISED:
                raise ModelSpecError(
                    f"{where}: batch normalisation must follow a conv or fc layer",
                    "write it right after one, e.g. 'conv5x5:10,bn,maxpool2'",
                    layer=i,
                )
            layers.append(Layer(i, "bn", tok, shape, shape))
        else:
            raise ModelSpecError(
                f"{where} does not parse",
                "layers are conv<KH>x<KW>:<filters>, maxpool2, fc<outputs> or bn",
                layer=i,
            )
        shape = layers[-1].out_shape
    last = layers[-1]
    if last.kind != "fc":
        raise ModelSpecError(
            f"layer {last.index} ({last.token!r}) of spec {spec!r}: the last "
            "layer must be fc<classes> (it gives the logits)",
            "end the spec with e.g. 'fc10'",
            layer=last.index,
        )
    if last.out_shape[0] < 2:
        raise ModelSpecError(
            f"layer {last.index} ({last.token!r}): a classifier needs at least 2 classes",
            layer=last.index,
        )
    for j, L in enumerate(layers[:-1]):
        if L.kind not in _NORMALISED:
            continue
        # the activation goes on the last of L, its bn, and (after a conv) the pooling
        k = j
        if layers[k + 1].kind == "bn":
            k += 1
        if L.kind == "conv" and layers[k + 1].kind == "maxpool":
            k += 1  # act(pool(z)) == pool(act(z)): cheaper after the pool
        layers[k].act = activation
    return layers
