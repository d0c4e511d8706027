"""The layer-by-layer passes of the numba engine: one forward loop and one backward loop over a
run of layers, for a whole :class:`~adam_dask.model.network.Network` (its ``forward_into`` and
``backward_into``) and for a :class:`~adam_dask.model.stage.Stage` of a partitioned one.

The loops call one kernel per layer and pass (the fused step in :mod:`adam_dask.model.fused`
walks the same layers inside numba). They read a run's work buffers by position in the run
(``ctx.acts[j]``, ``ctx.cols[j]``, ...; for a whole network the position is the layer's index)
and its parameters by the network's names (``params["3.weight"]``). What the backward pass does
with a layer's gradient is the caller's :class:`GradientSink`:

* :class:`Accumulate` (``Network.backward_into``): adds every gradient into named buffers and
  leaves the weights alone;
* :class:`Update` (``Stage.backward_update``): the fused step's order, each layer's SGD update
  applied as soon as its gradient is known (after its input error was computed with the
  weights as they were), the dense layers without a gradient buffer.

Shapes follow :mod:`adam_dask.model.kernels`; nothing here checks them. No Dask, no I/O.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from ..errors import ModelSpecError
from . import fused as F
from . import kernels as K
from .spec import Layer

logger = logging.getLogger(__name__)

__all__ = [
    "ACT_BWD",
    "ACT_FWD",
    "Accumulate",
    "GradientSink",
    "LayerBuffers",
    "Update",
    "backward_layers",
    "forward_layers",
    "softmax_loss",
]

ACT_FWD = {"tanh": K.tanh_forward, "relu": K.relu_forward}
ACT_BWD = {"tanh": K.tanh_backward, "relu": K.relu_backward}


class LayerBuffers(Protocol):
    """A run of layers' work buffers (a network's ``Context``, a stage's ``StageContext``), by
    position in the run: ``acts`` / ``errs`` (B, *out_shape), ``cols`` / ``dcols`` (conv),
    ``argmax`` (pooling), ``stats`` (bn); ``probs`` / ``losses`` for the loss; ``dummy`` stands
    for an input error nobody needs."""

    acts: list[np.ndarray]
    errs: list[np.ndarray]
    cols: dict[int, np.ndarray]
    dcols: dict[int, np.ndarray]
    argmax: dict[int, np.ndarray]
    stats: dict[int, np.ndarray]
    probs: np.ndarray
    losses: np.ndarray
    dummy: np.ndarray


class GradientSink(Protocol):
    """What :func:`backward_layers` does with the gradient of a layer's parameters."""

    def gradients(self, j: int, layer: Layer, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (weight, bias) buffers, shaped like ``w`` and the bias, that a conv or bn layer
        at position ``j`` adds its gradient to (zero unless accumulating)."""
        ...

    def done(self, j: int, layer: Layer) -> None:
        """Layer ``j``'s gradient is in :meth:`gradients`' buffers and its input's error is
        computed."""
        ...

    def dense(
        self,
        layer: Layer,
        dx: np.ndarray,
        dout: np.ndarray,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray,
        need_dx: bool,
    ) -> None:
        """A dense layer's backward: ``dx`` (n, I) from ``dout`` (n, O) with the weights ``w``
        as they are (``ctx.dummy`` and skipped unless ``need_dx``), and its gradient wrt
        ``w`` / ``b`` (``dout.T @ x``, ``dout.sum(0)``)."""
        ...


def forward_layers(
    layers: list[Layer],
    params: dict[str, np.ndarray],
    ctx: LayerBuffers,
    x: np.ndarray,
    n: int,
    *,
    train: bool = True,
    population: dict[int, np.ndarray] | None = None,
    collect: np.ndarray | None = None,
    dropout: float = 0.0,
    output: int = -1,
) -> np.ndarray | None:
    """Forward ``x[:n]`` through ``layers`` in ``ctx``; returns the last layer's output view
    (n, *out_shape). In training, ``dropout`` > 0: the outputs of the hidden dense layers (fc,
    index below ``output``, the network's output layer) go through inverted dropout after their
    activation (:func:`kernels.dropout_forward`, as the fused step does).

    ``train``: bn layers normalise by the batch's statistics (kept in ``ctx.stats`` for the
    backward pass), else by ``population`` (layer index -> (2, C) mean and variance). With
    ``collect`` ((2, C) float64), the first bn layer without population statistics adds its
    input's per-channel sum and sum of squares into it and the pass stops there (returns None):
    ``Network.calibrate``."""
    inp = x[:n]
    for j, L in enumerate(layers):
        i = L.index
        out = ctx.acts[j][:n]
        if L.kind == "conv":
            K.conv2d_forward(out, ctx.cols[j][:n], inp, params[f"{i}.weight"], params[f"{i}.bias"])
        elif L.kind == "maxpool":
            K.maxpool2_forward(out, ctx.argmax[j][:n], inp)
        elif L.kind == "bn":
            c = L.out_shape[0]
            x3, o3 = inp.reshape(n, c, -1), out.reshape(n, c, -1)
            gamma, beta = params[f"{i}.weight"], params[f"{i}.bias"]
            if train:
                K.batchnorm_forward(o3, ctx.stats[j], x3, gamma, beta, K.BN_EPS)
            elif population is not None and i in population:
                mean, var = population[i]
                K.batchnorm_infer(o3, x3, mean, var, gamma, beta, K.BN_EPS)
            elif collect is not None:
                x64 = x3.astype(np.float64)
                collect[0] += x64.sum(axis=(0, 2))
                collect[1] += (x64 * x64).sum(axis=(0, 2))
                return None
            else:
                raise ModelSpecError(
                    f"layer {i} normalises by population statistics this network does not "
                    "have yet (new or just-assigned weights)",
                    "call net.calibrate(training_images) before inference",
                    layer=i,
                )
        else:
            K.dense_forward(out, inp.reshape(n, -1), params[f"{i}.weight"], params[f"{i}.bias"])
        if L.act is not None:
            ACT_FWD[L.act](out)
        if train and dropped(L, dropout, output):
            K.dropout_forward(out, dropout, -1)
        inp = out
    return inp


def dropped(layer: Layer, dropout: float, output: int) -> bool:
    """Whether ``layer``'s output goes through dropout: a hidden dense layer, rate > 0."""
    return dropout > 0.0 and layer.kind == "fc" and layer.index < output


def softmax_loss(
    ctx: LayerBuffers,
    logits: np.ndarray,
    dlogits: np.ndarray,
    labels: np.ndarray,
    n: int,
    smoothing: float,
) -> float:
    """The mean softmax cross-entropy of ``logits`` (n, classes) against ``labels[:n]`` (with
    label ``smoothing``); writes its gradient wrt the logits into ``dlogits`` (n, classes)."""
    probs = ctx.probs[:n]
    y = labels[:n]
    loss = K.softmax_cross_entropy_forward(probs, ctx.losses[:n], logits, y, smoothing)
    K.softmax_cross_entropy_backward(dlogits, probs, y, np.float32(1.0 / n), smoothing)
    return float(loss)


def backward_layers(
    layers: list[Layer],
    params: dict[str, np.ndarray],
    ctx: LayerBuffers,
    x: np.ndarray,
    n: int,
    sink: GradientSink,
    din: np.ndarray | None = None,
    dropout: float = 0.0,
    output: int = -1,
) -> None:
    """Backward through ``layers`` from the error wrt the last one's output (already in
    ``ctx.errs[-1][:n]``, before its dropout and activation's derivative) down to ``din[:n]``,
    the error wrt ``x`` (the run's input of the forward pass); ``din`` None: the run starts the
    network and nobody needs it. Each layer's parameter gradient goes to ``sink``. ``dropout``,
    ``output``: as :func:`forward_layers` (a dropped layer's mask is read from its output)."""
    for j in range(len(layers) - 1, -1, -1):
        L = layers[j]
        i = L.index
        dout = ctx.errs[j][:n]
        if dropped(L, dropout, output):  # its mask is in its output (relu: kept values > 0)
            K.dropout_backward(dout, ctx.acts[j][:n], dropout)
        if L.act is not None:
            ACT_BWD[L.act](dout, ctx.acts[j][:n])
        inp = x[:n] if j == 0 else ctx.acts[j - 1][:n]
        need_dx = j > 0 or din is not None
        if j > 0:
            dinp = ctx.errs[j - 1][:n]
        else:
            dinp = din[:n] if din is not None else ctx.dummy
        if L.kind == "maxpool":
            if need_dx:
                K.maxpool2_backward(dinp, dout, ctx.argmax[j][:n])
            continue
        w, b = params[f"{i}.weight"], params[f"{i}.bias"]
        if L.kind == "fc":
            sink.dense(L, dinp.reshape(n, -1) if need_dx else ctx.dummy, dout, inp, w, b, need_dx)
            continue
        gw, gb = sink.gradients(j, L, w)
        if L.kind == "conv":
            K.conv2d_backward_weights(gw, gb, dout, ctx.cols[j][:n])
            if need_dx:
                K.conv2d_backward_input(dinp, ctx.dcols[j], dout, w)
        else:  # bn: never first in a network (it follows a conv or fc layer); may be in a stage
            c = L.out_shape[0]
            K.batchnorm_backward(
                dinp.reshape(n, c, -1),
                gw,
                gb,
                dout.reshape(n, c, -1),
                inp.reshape(n, c, -1),
                ctx.stats[j],
                w,
            )
        sink.done(j, L)


class Accumulate:
    """A :class:`GradientSink` that adds every gradient into ``grads`` (name -> buffer, e.g. a
    context's ``gviews``) and leaves the weights alone. With ``dense_terms`` a dict, it records
    each dense layer's (input activations, error terms) copies under its index."""

    def __init__(self, grads: dict[str, np.ndarray], dense_terms: dict | None = None):
        self.grads = grads
        self.dense_terms = dense_terms

    def gradients(self, j: int, layer: Layer, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = layer.index
        return self.grads[f"{i}.weight"], self.grads[f"{i}.bias"]

    def done(self, j: int, layer: Layer) -> None:
        pass

    def dense(self, layer, dx, dout, x, w, b, need_dx) -> None:
        i = layer.index
        a2 = x.reshape(x.shape[0], -1)
        if self.dense_terms is not None:
            self.dense_terms[str(i)] = (a2.copy(), dout.copy())
        K.dense_backward(
            dx, self.grads[f"{i}.weight"], self.grads[f"{i}.bias"], dout, a2, w, need_dx
        )


class Update:
    """A :class:`GradientSink` that applies each layer's SGD step to the weights in ``flat`` and
    adds it to ``acc`` (like ``flat``) as soon as the layer's gradient is known: ``u = momentum
    * v - lr * grad`` (``v <- u``, ``velocity`` like ``flat``; plain ``-lr * grad`` when
    ``momentum`` is 0 or ``velocity`` None). ``offsets``: a parameter's name -> its offset in
    ``flat``; ``grads``: position -> a conv or bn layer's flat (weight, bias) gradient buffer,
    zero between steps (each update zeroes it); ``row``: the dense layers' scratch row."""

    def __init__(
        self,
        flat: np.ndarray,
        offsets: dict[str, int],
        acc: np.ndarray,
        lr: float,
        grads: dict[int, np.ndarray],
        row: np.ndarray,
        velocity: np.ndarray | None = None,
        momentum: float = 0.0,
    ):
        self.flat, self.offsets, self.acc, self.lr = flat, offsets, acc, lr
        self.grads, self.row = grads, row
        self.momentum = float(momentum) if velocity is not None else 0.0
        self.velocity = velocity if self.momentum > 0.0 else None
        self.none = np.zeros(0, np.float32)  # no velocity: plain SGD

    def _velocity(self, lo: int, hi: int) -> np.ndarray:
        return self.none if self.velocity is None else self.velocity[lo:hi]

    def gradients(self, j: int, layer: Layer, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = self.grads[j]
        return g[: w.size].reshape(w.shape), g[w.size :]

    def done(self, j: int, layer: Layer) -> None:
        g = self.grads[j]
        lo = self.offsets[f"{layer.index}.weight"]
        hi = lo + g.shape[0]
        v = self._velocity(lo, hi)
        F.sgd_update_into(self.flat[lo:hi], self.acc[lo:hi], g, v, self.lr, self.momentum)

    def dense(self, layer, dx, dout, x, w, b, need_dx) -> None:
        lo = self.offsets[f"{layer.index}.weight"]
        o, isz = w.shape
        mid, hi = lo + w.size, lo + w.size + b.size
        vw = self._velocity(lo, mid).reshape(-1, isz)
        F.dense_backward_update(
            dx,
            w,
            b,
            vw,
            self._velocity(mid, hi),
            self.acc[lo:mid].reshape(o, isz),
            self.acc[mid:hi],
            self.row[:isz],
            dout,
            x.reshape(x.shape[0], -1),
            self.lr,
            self.momentum,
            need_dx,
        )
