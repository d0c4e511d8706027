"""A convolutional network described by a spec string, its parameters in one flat float32 buffer.

>>> net = Network.from_spec("conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc400,fc400,fc10",
...                         input_shape=(1, 28, 28), activation="tanh", seed=0)
>>> sorted(net.parameters)[:2], net.parameters["0.weight"].shape, net.classes
(['0.bias', '0.weight'], (10, 1, 5, 5), 10)

The spec grammar is in :mod:`adam_dask.model.spec`.

Work buffers live in a :class:`Context` (one per thread, sized for a batch), so the hot loop of a
replica allocates nothing; the convenience methods (``forward``, ``loss_and_gradient``) keep a
context per thread and batch size.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from .. import config
from ..errors import ModelSpecError
from . import checks
from . import fused as F
from .context import Context
from .layout import ParameterLayout
from .passes import Accumulate, backward_layers, forward_layers, softmax_loss
from .protocol import FlatBuffer, accuracy, describe, predict
from .spec import ACTIVATIONS, Layer, parse_spec

logger = logging.getLogger(__name__)

__all__ = ["ACTIVATIONS", "Context", "Layer", "Network", "parameter_entries", "parse_spec"]


def _fraction(name: str, value: float | None) -> float:
    """The training option ``name`` (argument ``name=``, else config ``adam.model.<name>`` with
    dashes) as a float in [0, 1), where 0 turns it off."""
    key = name.replace("_", "-")
    v = float(config.get(f"model.{key}", value))
    if not 0.0 <= v < 1.0:
        raise ModelSpecError(
            f"{name}={v} must lie in [0, 1)",
            f"set {name}= or adam.model.{key} (0 turns it off)",
        )
    return v


def parameter_entries(layers: list[Layer]) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of ``layers``, in the flat buffer's order."""
    entries: list[tuple[str, tuple[int, ...]]] = []
    for L in layers:
        if L.kind == "bn":
            entries += [
                (f"{L.index}.weight", (L.out_shape[0],)),
                (f"{L.index}.bias", (L.out_shape[0],)),
            ]
        elif L.kind == "conv":
            kh, kw = L.kernel
            entries += [
                (f"{L.index}.weight", (L.out_shape[0], L.in_shape[0], kh, kw)),
                (f"{L.index}.bias", (L.out_shape[0],)),
            ]
        elif L.kind == "fc":
            entries += [
                (f"{L.index}.weight", (L.out_shape[0], L.in_size)),
                (f"{L.index}.bias", (L.out_shape[0],)),
            ]
    return entries


class Network:
    """A feed-forward conv net with every parameter in one flat float32 buffer.

    Build with :meth:`from_spec`. Attributes: ``spec`` (str), ``input_shape`` (C, H, W),
    ``activation``, ``classes``, ``layers`` (the plan), ``layout`` (:class:`ParameterLayout`),
    ``flat`` (1-D float32, all parameters; assigning to it copies values in, so the views stay
    valid) and ``parameters`` (name -> view into ``flat``). ``dropout``: the rate of inverted
    dropout on the hidden dense layers' outputs in the training step (:meth:`step_into`; 0, the
    default, is the paper's network; relu only); inference and :meth:`backward_into` never drop.
    ``label_smoothing``: the weight of the uniform distribution in the training target,
    ``(1 - label_smoothing) * onehot + label_smoothing / classes`` (0, the default, is the
    paper's cross-entropy); it changes the loss, so :meth:`backward_into` uses it too.

    A spec with ``bn`` layers (batch normalisation, not one of the paper's layers) trains with
    each mini-batch's statistics; inference needs the population's, which depend on the
    weights: :meth:`calibrate` recomputes them from training images (the Trainer does it before
    it evaluates). They are not parameters: assigning ``flat`` drops them, and a network that
    has none refuses to infer (:attr:`population`, :attr:`batch_norm`).
    """

    def __init__(
        self,
        spec: str,
        input_shape: tuple[int, ...] = (1, 28, 28),
        activation: str | None = None,
        dropout: float | None = None,
        label_smoothing: float | None = None,
    ):
        activation = config.get("model.activation", activation)
        if activation not in ACTIVATIONS:
            raise ModelSpecError(
                f"unknown activation {activation!r}",
                f"use one of {', '.join(ACTIVATIONS)} (argument activation= or "
                "config adam.model.activation)",
            )
        dropout = _fraction("dropout", dropout)
        if dropout > 0.0 and activation != "relu":
            raise ModelSpecError(
                f"dropout needs the relu activation, not {activation!r}",
                "set adam.model.activation to relu, or dropout to 0",
            )
        self.dropout = dropout
        self.label_smoothing = _fraction("label_smoothing", label_smoothing)
        input_shape = checks.image_shape(input_shape)
        self.spec = (
            ",".join(t.strip().lower() for t in spec.split(",")) if isinstance(spec, str) else spec
        )
        self.input_shape = input_shape
        self.activation = activation
        self.layers = parse_spec(spec, input_shape, activation)
        self.classes = self.layers[-1].out_shape[0]
        for j, L in enumerate(self.layers[:-1]):
            if dropout > 0.0 and L.kind == "fc" and self.layers[j + 1].kind == "bn":
                raise ModelSpecError(
                    f"dropout on a dense layer followed by batch normalisation (layer {j}) is "
                    "not supported",
                    "set dropout to 0, or drop the bn after the dense layers",
                    layer=j,
                )
        #: bn layer index -> its population (mean, var) per channel, (2, C) float32; set by
        #: :meth:`calibrate`, dropped when ``flat`` is assigned
        self.population: dict[int, np.ndarray] = {}
        self.layout = ParameterLayout(parameter_entries(self.layers))
        self._flat = self.layout.allocate()
        self.parameters: dict[str, np.ndarray] = self.layout.views(self._flat)
        # the public passes' work buffers, by (thread, batch size): a plain dict, not a
        # threading.local, whose collection by the GC inside sys._current_frames() deadlocks
        # CPython 3.11 (gh-106883; a worker's Network is cyclic garbage, and Dask's task
        # profiler calls it every 10 ms: adam.cluster.task-profiler)
        self._contexts: dict[tuple[int, int], Context] = {}

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_spec(
        cls,
        spec: str | None = None,
        input_shape: tuple[int, ...] = (1, 28, 28),
        activation: str | None = None,
        seed: int = 0,
        dropout: float | None = None,
        label_smoothing: float | None = None,
    ) -> Network:
        """Parse ``spec`` (default: config ``adam.model.spec``) and initialise the weights:
        Glorot-uniform for tanh, He-normal for relu, zero biases, from ``seed`` (a bn layer
        starts as the identity: scale 1, shift 0)."""
        net = cls(config.get("model.spec", spec), input_shape, activation, dropout, label_smoothing)
        net.initialize(seed)
        return net

    def initialize(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.population = {}
        for L in self.layers:
            if not L.has_params:
                continue
            w = self.parameters[f"{L.index}.weight"]
            if L.kind == "bn":
                w[...] = 1.0
                self.parameters[f"{L.index}.bias"][...] = 0.0
                continue
            fan_in = int(np.prod(w.shape[1:]))
            fan_out = w.shape[0] * int(np.prod(w.shape[2:]))
            if self.activation == "relu":
                w[...] = rng.normal(0.0, np.sqrt(2.0 / fan_in), w.shape)
            else:
                a = np.sqrt(6.0 / (fan_in + fan_out))
                w[...] = rng.uniform(-a, a, w.shape)
            self.parameters[f"{L.index}.bias"][...] = 0.0

    def to_dict(self) -> dict:
        """A JSON-safe description (no weights), for checkpoint manifests."""
        return {
            "spec": self.spec,
            "input_shape": list(self.input_shape),
            "activation": self.activation,
            "dropout": self.dropout,
            "label_smoothing": self.label_smoothing,
            "classes": self.classes,
            "parameters": self.layout.size,
        }

    @classmethod
    def from_checkpoint(cls, url: str, storage_options: dict | None = None) -> Network:
        """The network a checkpoint at ``url`` (a run folder) was trained with, holding the
        checkpoint's weights (:func:`adam_dask.load` reads either engine's); a spec with
        ``bn`` layers then needs :meth:`calibrate` before inference."""
        from ..checkpoint_io import read_model
        from ._factory_path import TORCH

        _, d, values = read_model(url, storage_options)
        if d.get("engine") == TORCH:
            raise ModelSpecError(
                f"the checkpoint at {url} holds a PyTorch model ({d.get('factory')})",
                "read it with adam_dask.load(url), which gives either engine's network",
            )
        net = cls.from_dict(d)
        net.flat = values
        return net

    @classmethod
    def from_dict(cls, d: dict, seed: int = 0) -> Network:
        """The network ``d`` (from :meth:`to_dict`) describes, freshly initialised from ``seed``."""
        try:
            net = cls.from_spec(
                d["spec"],
                tuple(d["input_shape"]),
                d["activation"],
                seed=seed,
                dropout=float(d.get("dropout", 0.0)),
                label_smoothing=float(d.get("label_smoothing", 0.0)),
            )
        except KeyError as e:
            raise ModelSpecError(
                f"a network description lacks the key {e}", "build it with Network.to_dict()"
            ) from None
        if "classes" in d and d["classes"] != net.classes:
            raise ModelSpecError(
                f"description says {d['classes']} classes, its spec gives {net.classes}"
            )
        return net

    def copy(self) -> Network:
        """A new network with the same spec and a copy of the weights (and of the population
        statistics of its bn layers)."""
        other = type(self)(
            self.spec, self.input_shape, self.activation, self.dropout, self.label_smoothing
        )
        other.flat = self._flat
        other.population = {i: s.copy() for i, s in self.population.items()}
        return other

    @property
    def batch_norm(self) -> bool:
        """Whether the spec has bn layers (inference then needs :meth:`calibrate`)."""
        return any(L.kind == "bn" for L in self.layers)

    def __repr__(self) -> str:
        return describe(self, activation=self.activation)

    flat = FlatBuffer()

    def weights_assigned(self) -> None:
        """New weights in ``flat``: the old population statistics no longer describe them."""
        self.population = {}

    # -- input checks -----------------------------------------------------------------------------

    def check_input(self, x) -> np.ndarray:
        """``x`` as a C-contiguous float32 (B, C, H, W) array, or :class:`InputShapeError`."""
        return checks.check_input(x, self.input_shape)

    def check_labels(self, y, n: int) -> np.ndarray:
        """``y`` as int64 (n,) within [0, classes), or :class:`InputShapeError`."""
        return checks.check_labels(y, n, self.classes)

    def as_images(self, x) -> np.ndarray:
        """Images of any common form as float32 (N, C, H, W): uint8 (N, H, W) / (N, H, W, C) /
        (N, C, H, W) scaled by 1/255, or float arrays as they are."""
        return checks.as_images(x, self.input_shape)

    # -- contexts ---------------------------------------------------------------------------------

    def context(self, batch_size: int) -> Context:
        """New work buffers for batches of up to ``batch_size`` images (one per thread)."""
        return Context(self, batch_size)

    def _thread_context(self, batch_size: int) -> Context:
        """This thread's work buffers for ``batch_size`` (a thread's own key: no other thread
        reads or replaces them; ended threads' are dropped with the rest past a bound)."""
        key = (threading.get_ident(), int(batch_size))
        ctx = self._contexts.get(key)
        if ctx is None:
            if len(self._contexts) > 32:
                self._contexts.clear()  # a thread holding one keeps it for its pass
            ctx = self._contexts[key] = Context(self, batch_size)
        return ctx

    # -- the passes (no checks: callers validated x and y) -------------------------------------

    def forward_into(
        self,
        ctx: Context,
        x: np.ndarray,
        n: int | None = None,
        train: bool = False,
        collect: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Forward ``x[:n]`` through the net in ``ctx``; returns the logits view (n, classes).

        ``train``: bn layers normalise by the batch's statistics (kept in ``ctx.stats`` for
        the backward pass), else by :attr:`population`. With ``collect`` ((2, C) float64), the
        first bn layer without population statistics adds its input's per-channel sum and sum
        of squares into it and the pass stops there (returns None): :meth:`calibrate`."""
        n = x.shape[0] if n is None else n
        return forward_layers(
            self.layers,
            self.parameters,
            ctx,
            x,
            n,
            train=train,
            population=self.population,
            collect=collect,
        )

    def backward_into(
        self,
        ctx: Context,
        x: np.ndarray,
        y: np.ndarray,
        n: int | None = None,
        grads: dict[str, np.ndarray] | None = None,
        dense_terms: dict | None = None,
    ) -> float:
        """Forward and backward ``x[:n]``, ``y[:n]`` in ``ctx``; *adds* the gradient of the mean
        loss into ``grads`` (default ``ctx.gviews``) and returns the mean loss. When
        ``dense_terms`` is a dict, fills it with name prefix -> (activations, errors) copies."""
        n = x.shape[0] if n is None else n
        logits = self.forward_into(ctx, x, n, train=True)
        assert logits is not None
        last = self.layers[-1].index
        loss = softmax_loss(ctx, logits, ctx.errs[last][:n], y, n, self.label_smoothing)
        sink = Accumulate(ctx.gviews if grads is None else grads, dense_terms)
        backward_layers(self.layers, self.parameters, ctx, x, n, sink)
        return loss

    def step_into(
        self,
        ctx: Context,
        x: np.ndarray,
        y: np.ndarray,
        n: int | None,
        lr: float,
        momentum: float,
        velocity: np.ndarray,
        acc: np.ndarray | None = None,
        dense_terms: dict | None = None,
    ) -> float:
        """One SGD step on ``x[:n]``, ``y[:n]`` in one numba call (the GIL is released for all
        of it): forward, backward and ``flat += u, u = momentum * velocity - lr * grad``
        (``velocity`` like ``flat`` when momentum > 0, else unused), each layer updated as soon
        as its gradients are known. The same parameters as :meth:`backward_into` followed by
        ``kernels.sgd_update(flat, ctx.grad, velocity, lr, momentum)``, up to float rounding.
        With ``acc`` (float32 like ``flat``), ``acc += u`` too: a replica's accumulator of its
        updates. Returns the mean loss.

        ``x`` float32 C-contiguous (B, C, H, W), ``y`` int64 (B,), already checked
        (:meth:`check_input`, :meth:`check_labels`); ``ctx.grad`` must be zero (as every step
        leaves it). With ``dense_terms`` a dict, it is filled like :meth:`backward_into`'s. The
        other arguments are checked as the torch engine's are
        (:func:`~adam_dask.model.checks.check_step`: ``ctx`` made by this network, ``n``,
        ``velocity``, ``acc``)."""
        return F.step(self, ctx, x, y, n, lr, momentum, velocity, acc, dense_terms)

    # -- the public passes ------------------------------------------------------------------------

    def forward(self, x, batch_size: int = 256) -> np.ndarray:
        """Logits (B, classes) float32 of images ``x`` (B, C, H, W) float32 (inference: bn
        layers use the population statistics, see :meth:`calibrate`)."""
        x = self.check_input(x)
        N = x.shape[0]
        bs = min(int(batch_size), N)
        ctx = self._thread_context(bs)
        out = np.empty((N, self.classes), np.float32)
        for s in range(0, N, bs):
            chunk = x[s : s + bs]
            logits = self.forward_into(ctx, chunk)
            assert logits is not None
            out[s : s + len(chunk)] = logits
        return out

    def calibrate(self, x, batch_size: int = 256) -> None:
        """Set the population statistics of the bn layers from images ``x`` (any form
        :meth:`as_images` accepts; training images, without augmentation): each layer's mean
        and (biased) variance over all of ``x``, the earlier bn layers already normalising by
        theirs, as they will at inference. One pass over ``x`` per bn layer; nothing to do for
        a network without bn layers."""
        if not self.batch_norm:
            return
        x = self.as_images(x)
        N = x.shape[0]
        bs = min(int(batch_size), N)
        ctx = self._thread_context(bs)
        self.population = {}
        for L in self.layers:
            if L.kind != "bn":
                continue
            sums = np.zeros((2, L.out_shape[0]), np.float64)
            for s in range(0, N, bs):
                self.forward_into(ctx, x[s : s + bs], collect=sums)
            count = N * int(np.prod(L.out_shape[1:]))
            mean = sums[0] / count
            var = np.maximum(sums[1] / count - mean * mean, 0.0)
            self.population[L.index] = np.stack([mean, var]).astype(np.float32)

    def loss_and_gradient(self, x, y, dense_terms: bool = False):
        """Mean softmax cross-entropy of the batch and its gradient wrt ``flat``.

        Parameters
        ----------
        x : float32 (B, C, H, W)
        y : integer (B,) in [0, classes)
        dense_terms : bool
            Also return the paper's dense-layer offload terms.

        Returns
        -------
        ``(loss, grad)``: loss a float, grad a new float32 array like ``flat``. With
        ``dense_terms=True``, ``(loss, grad, terms)`` where ``terms`` maps each fc layer's name
        prefix (e.g. ``"5"``) to ``(activations (B, I), errors (B, O))`` float32: the layer's
        input and the gradient of the *mean* loss wrt its pre-activation output (the 1/B of the
        mean is already inside the errors), so that ``grad["5.weight"] == errors.T @
        activations`` and ``grad["5.bias"] == errors.sum(0)``. A parameter server applying
        ``w -= lr * errors.T @ activations`` therefore makes the same step as ``flat -= lr *
        grad``.
        """
        x = self.check_input(x)
        y = self.check_labels(y, x.shape[0])
        ctx = self._thread_context(x.shape[0])
        ctx.grad[...] = 0.0
        terms: dict | None = {} if dense_terms else None
        loss = self.backward_into(ctx, x, y, dense_terms=terms)
        grad = ctx.grad.copy()
        return (loss, grad, terms) if dense_terms else (loss, grad)

    def predict(self, x, batch_size: int = 256) -> np.ndarray:
        """Class labels (B,) int64 of images ``x`` (any form :meth:`as_images` accepts)."""
        return predict(self, x, batch_size)

    def evaluate(self, x, y, batch_size: int = 256) -> float:
        """Accuracy in [0, 1] on images ``x`` (float32 (N, C, H, W), or uint8 (N, H, W) /
        (N, H, W, C) scaled by 1/255) with labels ``y`` (N,)."""
        return accuracy(self, x, y, batch_size)
