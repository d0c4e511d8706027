"""A stage of a partitioned network: a run of consecutive layers with their own weights, whose
forward pass takes the previous stage's activations and whose backward pass takes the next
stage's error terms (paper 3.2, Figure 6: a model replica split over several machines).

A :class:`Stage` holds only its layers' parameters: ``flat`` is the slice ``[start, stop)`` of
the whole network's flat buffer (layers are laid out in order, so consecutive layers are one
contiguous span). The passes are the network's own layer loops (:mod:`adam_dask.model.passes`),
in a :class:`StageContext` per mini-batch in flight (its activations must survive until that
mini-batch's error terms come back from the next stage):

* :meth:`Stage.forward_into` ``(ctx, x, n)``: the stage's output activations (B, *out_shape);
  the last stage's output are the logits.
* :meth:`Stage.backward_update` ``(ctx, n, lr, acc, dout=... | labels=...)``: the backward
  pass and the SGD update of every layer of the stage as soon as its gradient is known (the
  fused step's order: each layer's input error is computed with its weights as they were,
  then the weights move). ``acc`` (like ``flat``) receives the same updates: what the stage
  pushes to the parameter server. Writes ``ctx.din`` (the error wrt the stage's input) unless
  it is the first stage; the last stage takes ``labels`` and returns the mean loss.

With ``lr=1`` and a zero ``acc``, ``acc`` is minus the stage's part of the gradient of the mean
loss, and the stages' parts side by side equal :meth:`Network.loss_and_gradient`
(``tests/model/test_stage.py``).

Shapes follow :mod:`adam_dask.model.kernels`. No Dask, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import fused as F
from . import kernels as K
from .layout import ParameterLayout
from .network import Network, parameter_entries
from .passes import (
    ACT_BWD,
    ACT_FWD,
    Update,
    backward_layers,
    dropped,
    forward_layers,
    softmax_loss,
)
from .spec import Layer, parse_spec

logger = logging.getLogger(__name__)

_NO_VELOCITY = np.zeros(1, np.float32)  # the fused step's velocity without momentum (unused)

__all__ = ["Skeleton", "Stage", "StageContext", "WholeStage", "stages_of"]


class Skeleton:
    """A network's plan without its weights (``layers``, ``layout``, ``classes``,
    ``label_smoothing``, ``dropout``): what a partition builds its :class:`Stage` from, so a
    worker never allocates the whole model. ``d``: :meth:`Network.to_dict`."""

    def __init__(self, d: dict):
        self.layers = parse_spec(d["spec"], tuple(d["input_shape"]), d["activation"])
        self.layout = ParameterLayout(parameter_entries(self.layers))
        self.classes = self.layers[-1].out_shape[0]
        self.label_smoothing = float(d.get("label_smoothing", 0.0))
        self.dropout = float(d.get("dropout", 0.0))
        self.description = d


class Stage:
    """Layers ``net.layers[first:stop]`` of ``net`` as one stage with its own weights.

    Attributes: ``layers``, ``start`` / ``stop`` (its span of the whole flat buffer), ``flat``
    (its weights, float32 (stop - start,)), ``parameters`` (the network's names -> views into
    ``flat``), ``in_shape`` / ``out_shape`` (per image), ``last`` (it computes the loss),
    ``classes``, ``label_smoothing``.
    """

    def __init__(
        self,
        net: Network | Skeleton,
        first: int,
        stop: int,
        weights: np.ndarray | None = None,
        rows: tuple[int, int] | None = None,
    ):
        if not 0 <= first < stop <= len(net.layers):
            raise ValueError(f"no layers [{first}, {stop}) in a network of {len(net.layers)}")
        self.layers: list[Layer] = list(net.layers[first:stop])
        self.first, self.stop_layer = first, stop
        self.last = stop == len(net.layers)
        self.in_shape = tuple(self.layers[0].in_shape)
        self.out_shape = tuple(self.layers[-1].out_shape)
        self.classes = net.classes
        self.label_smoothing = net.label_smoothing
        # inverted dropout on the network's hidden dense layers (those before ``output``)
        self.dropout, self.output = float(net.dropout), len(net.layers) - 1
        self.rows = None if rows is None or tuple(rows) == (0, 0) else (int(rows[0]), int(rows[1]))
        if self.rows is not None:
            self._init_slice(net, weights)
            return
        names = [
            n for L in self.layers if L.has_params for n in (f"{L.index}.weight", f"{L.index}.bias")
        ]
        entries = [net.layout[n] for n in names]
        if entries:
            self.start = entries[0].offset
            self.stop = entries[-1].offset + entries[-1].size
        else:  # parameter-free layers only (pooling): an empty span where they sit
            self.start = self.stop = _offset_before(net, first)
        self.flat = np.zeros(self.stop - self.start, np.float32)
        if weights is None and isinstance(net, Network):
            weights = net.flat
        if weights is not None:  # a Skeleton's stage starts at zeros: pull its weights
            self.flat[...] = weights[self.start : self.stop]
        #: parameter name -> its offset in ``flat``
        self.offsets = {e.name: e.offset - self.start for e in entries}
        self.parameters: dict[str, np.ndarray] = {
            e.name: self.flat[e.offset - self.start : e.offset - self.start + e.size].reshape(
                e.shape
            )
            for e in entries
        }

    def _init_slice(self, net: Network | Skeleton, weights: np.ndarray | None) -> None:
        """Output rows ``[r0, r1)`` of one dense layer (paper Figure 6: a layer too wide for one
        worker split by output neurons). The slices of a layer are consecutive partitions:
        each one's input is the layer's input ``x`` and, after the first, the pre-activations
        of the rows before it; it sends on ``x`` and the rows up to its own, and the last slice
        (which also holds the whole bias, laid out right after the weights) adds the bias,
        applies the activation and sends the layer's output. Backward the other way: each
        slice updates its rows, adds its part ``dz_s @ W_s`` to the input's error and sends it
        back with the error terms of the rows before its own."""
        (L,) = self.layers
        if L.kind != "fc":
            raise ValueError(f"only a dense layer can be split by rows, not {L.kind!r}")
        assert self.rows is not None
        r0, r1 = self.rows
        O, I = L.out_shape[0], L.in_size
        if not 0 <= r0 < r1 <= O:
            raise ValueError(f"rows [{r0}, {r1}) of a dense layer of {O} outputs")
        we, be = net.layout[f"{L.index}.weight"], net.layout[f"{L.index}.bias"]
        self.O, self.I = O, I
        self.first_slice, self.last_slice = r0 == 0, r1 == O
        self.last = self.last and self.last_slice
        self.start = we.offset + r0 * I
        self.stop = we.offset + r1 * I if not self.last_slice else be.offset + O
        self.flat = np.zeros(self.stop - self.start, np.float32)
        if weights is None and isinstance(net, Network):
            weights = net.flat
        if weights is not None:
            self.flat[...] = weights[self.start : self.stop]
        self.weight = self.flat[: (r1 - r0) * I].reshape(r1 - r0, I)
        self.parameters = {f"{L.index}.weight[{r0}:{r1}]": self.weight}
        self.offsets = {f"{L.index}.weight[{r0}:{r1}]": 0}
        self.bias = self.flat[(r1 - r0) * I :] if self.last_slice else None
        if self.bias is not None:
            self.parameters[f"{L.index}.bias"] = self.bias
            self.offsets[f"{L.index}.bias"] = (r1 - r0) * I
        # messages: forward [x (I), pre-activations of rows [0, r)]; backward mirrored
        self.in_shape = tuple(L.in_shape) if self.first_slice else (I + r0,)
        self.out_shape = (O,) if self.last_slice else (I + r1,)

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def in_size(self) -> int:
        return int(np.prod(self.in_shape))

    @property
    def out_size(self) -> int:
        return int(np.prod(self.out_shape))

    def __repr__(self) -> str:
        toks = ",".join(L.token for L in self.layers)
        return f"Stage(layers {self.first}-{self.stop_layer - 1} {toks!r}, [{self.start}, {self.stop}))"

    def context(self, batch_size: int) -> StageContext:
        return StageContext(self, batch_size)

    # -- the passes ---------------------------------------------------------------------------

    def forward_into(self, ctx: StageContext, x: np.ndarray, n: int) -> np.ndarray:
        """Forward ``x[:n]`` (float32 (B, *in_shape), kept by reference for the backward pass)
        through the stage in ``ctx`` (training mode: bn by the batch's statistics); returns the
        output view (n, *out_shape)."""
        ctx.x = x
        if self.rows is not None:
            return self._slice_forward(ctx, x, n)
        out = forward_layers(
            self.layers, self.parameters, ctx, x, n, dropout=self.dropout, output=self.output
        )
        assert out is not None  # training: bn layers need no population
        return out

    def backward_update(
        self,
        ctx: StageContext,
        n: int,
        lr: float,
        acc: np.ndarray,
        *,
        dout: np.ndarray | None = None,
        labels: np.ndarray | None = None,
        velocity: np.ndarray | None = None,
        momentum: float = 0.0,
    ) -> float:
        """The backward pass of the mini-batch last forwarded in ``ctx`` and the update of the
        stage's weights (``flat += u`` and ``acc += u``, ``u = -lr * grad``; with ``momentum``
        > 0 and a ``velocity`` like ``flat``, the caller's, ``u = momentum * velocity - lr *
        grad`` and ``velocity <- u``, as the whole network's step).

        ``dout`` (n, *out_shape): the error wrt the stage's output (every stage but the last);
        ``labels`` (n,) int64: the last stage's targets (its loss is the mean softmax
        cross-entropy). Writes ``ctx.din[:n]`` (error wrt the input) unless the stage is first
        in the network. Returns the mean loss (last stage), else 0."""
        mu = float(momentum) if velocity is not None else 0.0
        if self.rows is not None:
            vel = velocity if mu > 0.0 else None
            return self._slice_backward(ctx, n, lr, acc, dout, labels, vel, mu)
        loss = 0.0
        dlast = ctx.errs[-1][:n]
        if self.last:
            assert labels is not None
            loss = softmax_loss(ctx, ctx.acts[-1][:n], dlast, labels, n, self.label_smoothing)
        else:
            assert dout is not None
            dlast[...] = dout[:n]
        sink = Update(self.flat, self.offsets, acc, lr, ctx.grads, ctx.row, velocity, mu)
        din = None if self.first == 0 else ctx.din  # the network's first layer: no input error
        backward_layers(
            self.layers, self.parameters, ctx, ctx.x, n, sink, din, self.dropout, self.output
        )
        return loss

    def _slice_forward(self, ctx: StageContext, x: np.ndarray, n: int) -> np.ndarray:
        assert self.rows is not None
        r0, _ = self.rows
        I, L = self.I, self.layers[0]
        xin = x[:n].reshape(n, -1)
        xs = xin if self.first_slice else np.ascontiguousarray(xin[:, :I])
        ctx.xs = xs
        z = ctx.z[:n]
        K.dense_forward(z, xs, self.weight, ctx.zero_bias)
        out = ctx.acts[0][:n].reshape(n, -1)
        if self.last_slice:
            assert self.bias is not None
            if r0:
                out[:, :r0] = xin[:, I:]
            out[:, r0:] = z
            out += self.bias
            if L.act is not None:
                ACT_FWD[L.act](out)
            if dropped(L, self.dropout, self.output):  # the layer's whole output
                K.dropout_forward(out, self.dropout, -1)
        else:
            out[:, :I] = xs
            if r0:
                out[:, I : I + r0] = xin[:, I:]
            out[:, I + r0 :] = z
        return ctx.acts[0][:n]

    def _slice_backward(
        self,
        ctx: StageContext,
        n: int,
        lr: float,
        acc: np.ndarray,
        dout: np.ndarray | None,
        labels: np.ndarray | None,
        velocity: np.ndarray | None,
        momentum: float,
    ) -> float:
        assert self.rows is not None
        r0, r1 = self.rows
        I, L = self.I, self.layers[0]
        loss = 0.0
        need_dx = self.first > 0  # the network's first layer: no input error
        dx = ctx.dx[:n]
        partial = None
        if self.last_slice:
            assert self.bias is not None
            dz = ctx.errs[0][:n]  # (n, O)
            y = ctx.acts[0][:n].reshape(n, -1)
            if self.last:
                assert labels is not None
                loss = softmax_loss(ctx, y, dz, labels, n, self.label_smoothing)
            else:
                assert dout is not None
                dz[...] = dout[:n].reshape(n, -1)
                if dropped(L, self.dropout, self.output):
                    K.dropout_backward(dz, y, self.dropout)
                if L.act is not None:
                    ACT_BWD[L.act](dz, y)
            ctx.gbias[...] = dz.sum(axis=0)
            nb = self.O
            vb = ctx.novel if velocity is None else velocity[velocity.shape[0] - nb :]
            F.sgd_update_into(self.bias, acc[acc.shape[0] - nb :], ctx.gbias, vb, lr, momentum)
            own = np.ascontiguousarray(dz[:, r0:])
            before = dz[:, :r0]
        else:
            assert dout is not None
            d = dout[:n].reshape(n, -1)
            partial = d[:, :I]
            own = np.ascontiguousarray(d[:, I + r0 : I + r1])
            before = d[:, I : I + r0]
        rows = r1 - r0
        F.dense_backward_update(
            dx if need_dx else ctx.dummy,
            self.weight,
            ctx.scratch_bias,
            ctx.novel.reshape(0, I) if velocity is None else velocity[: rows * I].reshape(rows, I),
            ctx.novel if velocity is None else ctx.scratch_bias_velocity,
            acc[: rows * I].reshape(rows, I),
            ctx.scratch_bias_acc,
            ctx.row[:I],
            own,
            ctx.xs,
            lr,
            momentum,
            need_dx,
        )
        din = ctx.din[:n].reshape(n, -1)
        if need_dx:
            if partial is not None:
                dx += partial
            din[:, :I] = dx
        if r0:
            din[:, I:] = before
        return loss


class StageContext:
    """Work buffers of one mini-batch in flight through a :class:`Stage` (up to ``batch_size``
    images): per layer ``acts`` / ``errs`` (B, *out_shape), ``cols`` / ``dcols`` (conv),
    ``argmax`` (pooling), ``stats`` (bn), ``grads`` (conv and bn: flat weight + bias, zero
    between steps); ``din`` (B, *in_shape): the error wrt the input; ``x``: the input of the
    last forward; ``probs`` / ``losses`` for the last stage; ``row``: the dense scratch."""

    def __init__(self, stage: Stage, batch_size: int):
        B = self.batch_size = int(batch_size)
        self.acts: list[np.ndarray] = []
        self.errs: list[np.ndarray] = []
        self.cols: dict[int, np.ndarray] = {}
        self.dcols: dict[int, np.ndarray] = {}
        self.argmax: dict[int, np.ndarray] = {}
        self.stats: dict[int, np.ndarray] = {}
        self.grads: dict[int, np.ndarray] = {}
        row = 1
        for j, L in enumerate(stage.layers):
            self.acts.append(np.zeros((B, *L.out_shape), np.float32))
            self.errs.append(np.zeros((B, *L.out_shape), np.float32))
            if L.kind == "conv":
                ckk = L.in_shape[0] * L.kernel[0] * L.kernel[1]
                pp = L.out_shape[1] * L.out_shape[2]
                self.cols[j] = np.zeros((B, ckk, pp), np.float32)
                self.dcols[j] = np.zeros((ckk, pp), np.float32)
            elif L.kind == "maxpool":
                self.argmax[j] = np.zeros((B, *L.out_shape), np.int8)
            elif L.kind == "bn":
                self.stats[j] = np.zeros((2, L.out_shape[0]), np.float32)
            elif L.kind == "fc":
                row = max(row, L.in_size)
            if L.kind in ("conv", "bn"):
                w = stage.parameters[f"{L.index}.weight"]
                self.grads[j] = np.zeros(w.size + L.out_shape[0], np.float32)
        self.din = np.zeros((B, *stage.in_shape), np.float32)
        self.x = self.din  # replaced by each forward's input
        self.row = np.zeros(row, np.float32)
        self.probs = np.zeros((B, stage.classes), np.float32)
        self.losses = np.zeros(B, np.float32)
        self.dummy = np.zeros((1, 1), np.float32)
        self.novel = np.zeros(0, np.float32)  # no velocity: plain SGD
        if stage.rows is not None:  # a dense layer's slice
            r0, r1 = stage.rows
            self.acts = [np.zeros((B, *stage.out_shape), np.float32)]
            self.errs = [np.zeros((B, stage.O), np.float32)]
            self.z = np.zeros((B, r1 - r0), np.float32)
            self.zero_bias = np.zeros(r1 - r0, np.float32)
            self.scratch_bias = np.zeros(r1 - r0, np.float32)  # the bias is the last slice's
            self.scratch_bias_acc = np.zeros(r1 - r0, np.float32)
            self.scratch_bias_velocity = np.zeros(r1 - r0, np.float32)
            self.gbias = np.zeros(stage.O, np.float32)
            self.dx = np.zeros((B, stage.I), np.float32)
            self.xs = self.dx
            self.row = np.zeros(stage.I, np.float32)

    @property
    def nbytes(self) -> int:
        arrays = [*self.acts, *self.errs, *self.cols.values(), *self.dcols.values()]
        arrays += [*self.argmax.values(), *self.grads.values(), self.din, self.row, self.probs]
        return int(sum(a.nbytes for a in arrays))


def _offset_before(net: Network | Skeleton, first: int) -> int:
    """The flat offset where layer ``first``'s parameters would start."""
    off = 0
    for L in net.layers[:first]:
        if L.has_params:
            e = net.layout[f"{L.index}.bias"]
            off = e.offset + e.size
    return off


class WholeStage:
    """The whole model as the pipeline's one stage, of either engine (a numba
    :class:`Network` or a :class:`~adam_dask.model.torch_engine.TorchNetwork`, anything with
    ``flat``, ``context`` and ``step_into``): the network's own buffer, trained by its fused
    step, as the engine alone (:class:`~adam_dask.train.replica.HogwildReplica`) trains it. No layer list is needed (a torch module has none)."""

    def __init__(self, net: Any, offload: Sequence[str] = ()):
        self.whole = net
        self.flat: np.ndarray = net.flat
        self.start, self.stop = 0, int(net.flat.size)
        #: dense layers whose updates travel as (activations, errors) terms (the paper's
        #: offload; numba engine): prefix -> (offset, size) of its weight in ``flat``
        self.offload: dict[str, tuple[int, int]] = {
            p: (net.layout[f"{p}.weight"].offset, net.layout[f"{p}.weight"].size)
            for p in sorted(offload)
        }

    @property
    def size(self) -> int:
        return self.stop - self.start

    def step(
        self,
        ctx: Any,
        x: np.ndarray,
        labels: np.ndarray,
        n: int,
        lr: float,
        acc: np.ndarray,
        *,
        velocity: np.ndarray | None = None,
        momentum: float = 0.0,
        terms: dict | None = None,
    ) -> float:
        """The forward, backward and update of ``x[:n]`` in one call of the network's fused
        step (``step_into``, the engine's; ``ctx`` from :meth:`context`):
        for the numba engine what a :class:`Stage`'s :meth:`~Stage.forward_into` and
        :meth:`~Stage.backward_update` do, up to float rounding. ``acc`` receives the update
        too; ``terms`` (a dict, with :attr:`offload`) the offloaded layers' ``(activations,
        -lr * errors)``. Returns the mean loss."""
        dense: dict | None = {} if terms is not None and self.offload else None
        if velocity is None or not momentum > 0.0:
            velocity, momentum = _NO_VELOCITY, 0.0
        loss = self.whole.step_into(
            ctx, x, labels, n, lr, float(momentum), velocity, acc=acc, dense_terms=dense
        )
        if dense:
            assert terms is not None
            for p in self.offload:
                acts, errs = dense[p]
                errs *= np.float32(-lr)  # the engine's own copies
                terms[p] = (acts, errs)
        return loss

    def context(self, batch_size: int) -> Any:
        """Work buffers for :meth:`step` (one per thread)."""
        return self.whole.context(batch_size)


def stages_of(net: Network | Skeleton, bounds: Sequence[Sequence[int]]) -> list[Stage]:
    """The stages of ``net`` for ``bounds`` [(first, stop), ...] (layer ranges) or
    [(first, stop, r0, r1), ...] (rows ``[r0, r1)`` of dense layer ``first`` when r1 > 0),
    consecutive and covering every layer, each with a copy of its weights from ``net.flat``."""
    at, row = 0, 0  # the next layer, and the next row of a layer being split
    stages = []
    for bound in bounds:
        a, b = int(bound[0]), int(bound[1])
        r0, r1 = (int(bound[2]), int(bound[3])) if len(bound) > 2 else (0, 0)
        if r1 > 0:  # a slice: a layer's rows in order
            if a != at or b != a + 1 or r0 != row:
                raise ValueError(f"layer ranges {list(bounds)} are not consecutive")
            row = r1
            if r1 == net.layers[a].out_shape[0]:
                at, row = b, 0
            stages.append(Stage(net, a, b, rows=(r0, r1)))
            continue
        if a != at or b <= a or row:
            raise ValueError(f"layer ranges {list(bounds)} are not consecutive")
        at = b
        stages.append(Stage(net, a, b))
    if at != len(net.layers) or row:
        raise ValueError(f"layer ranges {list(bounds)} do not cover {len(net.layers)} layers")
    return stages
