"""Bring your own model: a PyTorch ``nn.Module`` trained by Adam's replicas, data servers and
replicated parameter server (``pip install "adam_dask[torch]"``).

:class:`TorchNetwork` is the numba :class:`~adam_dask.model.network.Network`'s protocol around a
module: ``flat`` (every parameter in one float32 buffer), ``layout`` (a
:class:`~adam_dask.model.layout.ParameterLayout` named as ``module.named_parameters()``),
``context`` and ``step_into`` (one SGD step of a Hogwild thread), ``forward`` / ``predict`` /
``evaluate`` / ``calibrate``, ``to_dict`` / ``from_dict``. The replica, the exchange, the
parameter server, its sharding, replay, marks and checkpoints are the same code for both
engines.

* The module's parameters are views into ``flat``: ``param.data`` is
  ``torch.from_numpy(flat[offset:offset + size]).view(shape)``. Each Hogwild thread's
  :class:`TorchContext` holds its own copy of the module whose parameters view the *same*
  ``flat`` (shared weights, no locks, as the numba threads) and whose ``.grad`` view one flat
  gradient buffer of the thread's: after ``loss.backward()`` the gradient is one contiguous
  float32 array, and the numba kernel :func:`~adam_dask.model.fused.sgd_update_into` makes
  the update ``flat += u``, ``acc += u``, ``u = momentum * velocity - lr * grad`` exactly as
  for the numba engine.
* One intra-op thread per Hogwild thread (``torch.set_num_threads(1)`` in each): the replica's
  parallelism is its threads, as with the numba kernels.
* Buffers that are not parameters (batch norm's running statistics) stay out of ``flat``: each
  thread's copy updates its own while training, and they are never pushed. Before inference,
  :meth:`TorchNetwork.calibrate` recomputes them on the weights being evaluated from training
  images (the Trainer does it before every validation, as for the numba engine's ``bn``
  layers). Why not average them through the parameter server: they are not sums of updates
  (the server adds pushes), and a replica's running mean describes the weights it trained
  through, not the server's current ones.
* The loss is the user's (``loss(logits, labels)`` returning the batch's mean; default
  cross-entropy); the optimizer step is the paper's SGD, momentum optional.

>>> import torch
>>> net = TorchNetwork(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3)), (1, 4, 4))
>>> net.layout.size, net.classes, sorted(net.parameters)
(51, 3, ['1.bias', '1.weight'])
>>> net.parameters["1.weight"] is not None and net.flat.dtype.name
'float32'
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ModelSpecError
from . import checks
from ._factory_path import TORCH
from .fused import sgd_update_into
from .layout import ParameterLayout
from .protocol import FlatBuffer, accuracy, describe, predict
from .torch_module import (  # first: it says what to install when torch is missing
    as_float32,
    bind,
    build_module,
    describe_module,
    is_bn,
    load_factory,
    loss_name,
    nn,
    tensor,
    torch,
)

logger = logging.getLogger(__name__)

__all__ = ["TorchContext", "TorchNetwork", "load_factory"]

_threads = threading.local()  # whether this thread has set torch to one intra-op thread


class TorchContext:
    """One Hogwild thread's work state: its own copy of the module (parameters viewing the
    network's ``flat``, ``.grad`` viewing this context's ``grad``), in training mode."""

    def __init__(self, net: TorchNetwork, batch_size: int):
        self.batch_size = int(batch_size)
        self.network_id = id(net)  # a step checks that its context is its network's
        self.spec, self.input_shape = net.spec, net.input_shape
        self.grad = net.layout.allocate()
        self.module = copy.deepcopy(net.module)
        bind(self.module, net.layout, net.flat, self.grad)
        self.module.train()

    def __repr__(self) -> str:
        return f"TorchContext({describe_module(self.module)}, batch_size={self.batch_size})"


class TorchNetwork:
    """A PyTorch module with every parameter a view into one flat float32 buffer.

    Parameters
    ----------
    module : nn.Module
        The model; kept (as :attr:`module`, its parameters now views into :attr:`flat`) with
        its current weights as the starting point. Its ``forward`` takes float32
        (B, C, H, W) images and returns (B, classes) logits.
    input_shape : (C, H, W)
        The images it takes (the data store's).
    factory : str, optional
        The ``"package.module:callable"`` that builds it: replicas and checkpoints rebuild the
        module from it; without one, replica jobs carry the module cloudpickled, and a
        checkpoint needs the module again to be read (:meth:`from_dict`'s ``model=``).
    loss : callable, optional
        ``loss(logits, labels) -> scalar tensor`` (the batch's mean), default
        ``torch.nn.functional.cross_entropy``.
    """

    engine = TORCH

    def __init__(
        self,
        module: nn.Module,
        input_shape: tuple[int, ...],
        factory: str | None = None,
        loss: Callable | None = None,
    ):
        if not isinstance(module, nn.Module):
            raise ModelSpecError(
                f"expected an nn.Module, got {type(module).__name__}",
                "pass the module, a zero-argument callable returning one, or package.module:factory",
            )
        module = as_float32(module)
        self.input_shape = input_shape = checks.image_shape(input_shape)
        self.factory = factory
        self.loss = loss
        self._loss: Callable = loss if loss is not None else nn.functional.cross_entropy
        self.spec = f"torch:{factory or describe_module(module)}"
        named = list(module.named_parameters())
        if not named:
            raise ModelSpecError(f"the module {describe_module(module)} has no parameters to train")
        self.layout = ParameterLayout((name, tuple(p.shape)) for name, p in named)
        self._flat = self.layout.allocate()
        with torch.no_grad():
            for e, (_, p) in zip(self.layout, named):
                self._flat[e.offset : e.offset + e.size] = p.detach().reshape(-1).numpy()
        self.module = module
        bind(module, self.layout, self._flat)
        self.parameters: dict[str, np.ndarray] = self.layout.views(self._flat)
        #: whether the batch-norm running statistics describe the current weights: a module
        #: as given (or just calibrated) yes; after ``flat`` is assigned, no
        self.calibrated = True
        self.classes = self._probe_classes()

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        model: Any,
        input_shape: tuple[int, ...],
        seed: int | None = 0,
        loss: Callable | None = None,
    ) -> TorchNetwork:
        """A network from ``model``: an ``nn.Module`` (its weights kept), a zero-argument
        callable returning one, or a factory path (both called with torch's generator seeded
        from ``seed``), or a TorchNetwork (copied)."""
        if isinstance(model, TorchNetwork):
            net = model.copy()
            if loss is not None:
                net.loss, net._loss = loss, loss
            return net
        if isinstance(model, nn.Module):
            return cls(model, input_shape, loss=loss)
        if isinstance(model, str):
            return cls(
                build_module(load_factory(model), seed, repr(model)), input_shape, model, loss
            )
        if callable(model):
            what = getattr(model, "__qualname__", type(model).__name__)
            return cls(build_module(model, seed, what), input_shape, loss=loss)
        raise ModelSpecError(
            f"model={model!r} is not an nn.Module, a callable or a factory path",
            "pass an nn.Module, a zero-argument callable returning one, or package.module:factory",
        )

    def to_dict(self) -> dict:
        """A JSON-safe description (no weights, no pickle), for checkpoint manifests."""
        return {
            "engine": TORCH,
            "factory": self.factory,
            "module": describe_module(self.module),
            "input_shape": list(self.input_shape),
            "classes": self.classes,
            "loss": loss_name(self.loss),
            "parameters": self.layout.size,
            "layout": self.layout.to_dict(),
        }

    def job_dict(self) -> dict:
        """:meth:`to_dict` plus what a TRAIN worker needs that a manifest must not hold: the
        module (when it has no factory) and a custom loss, cloudpickled."""
        import cloudpickle

        d = self.to_dict()
        if self.factory is None:
            d["module_pickle"] = cloudpickle.dumps(self.module)
        if self.loss is not None:
            d["loss_pickle"] = cloudpickle.dumps(self.loss)
        return d

    @classmethod
    def from_dict(cls, d: dict, model: Any = None) -> TorchNetwork:
        """The network ``d`` (:meth:`to_dict` / :meth:`job_dict`) describes, its module rebuilt
        from ``model`` when given (an nn.Module, a callable or a factory path), else from the
        shipped module or the factory path; weights as the module was built (the caller
        installs the parameter server's or the checkpoint's). A module whose parameters differ
        from ``d``'s layout is refused with one :class:`ModelSpecError`."""
        try:
            input_shape = tuple(d["input_shape"])
            stored = ParameterLayout.from_dict(d["layout"])
        except KeyError as e:
            raise ModelSpecError(
                f"a torch model description lacks the key {e}",
                "build it with TorchNetwork.to_dict()",
            ) from None
        loss = None
        if d.get("loss_pickle") is not None:
            import cloudpickle

            loss = cloudpickle.loads(d["loss_pickle"])
        if model is not None:
            net = cls.build(model, input_shape, seed=None, loss=loss)
        elif d.get("module_pickle") is not None:
            import cloudpickle

            net = cls(cloudpickle.loads(d["module_pickle"]), input_shape, loss=loss)
        elif d.get("factory"):
            net = cls(
                build_module(load_factory(d["factory"]), None, repr(d["factory"])),
                input_shape,
                d["factory"],
                loss,
            )
        else:
            raise ModelSpecError(
                f"the run trained a module object ({d.get('module')}), which a checkpoint "
                "cannot rebuild",
                "pass model= (the same module class), or train with model='package.module:factory'",
            )
        net.check_layout(stored)
        return net

    @classmethod
    def from_checkpoint(
        cls, url: str, model: Any = None, storage_options: dict | None = None
    ) -> TorchNetwork:
        """The module a checkpoint at ``url`` was trained with (rebuilt from its factory path,
        or ``model`` as in :meth:`from_dict`), holding the checkpoint's weights; a module with
        batch norm then needs :meth:`calibrate` before inference."""
        from ..checkpoint_io import read_model

        _, d, values = read_model(url, storage_options)
        if d.get("engine") != TORCH:
            raise ModelSpecError(
                f"the checkpoint at {url} holds no PyTorch model ({d.get('spec')})",
                "read it with adam_dask.load(url), which gives either engine's network",
            )
        net = cls.from_dict(d, model=model)
        net.flat = values
        return net

    def check_layout(self, stored: ParameterLayout) -> None:
        """:class:`ModelSpecError` naming the first parameter where this module's layout and
        ``stored`` (a checkpoint's) differ."""
        if stored == self.layout:
            return
        mine = {e.name: e.shape for e in self.layout}
        theirs = {e.name: e.shape for e in stored}
        diff = next(
            (n for n in [*mine, *theirs] if mine.get(n) != theirs.get(n)),
            None,
        )
        if diff is not None:
            what = (
                f"{diff!r} is {mine.get(diff, 'absent')} here, {theirs.get(diff, 'absent')} there"
            )
        else:
            what = "the same tensors in another order"
        raise ModelSpecError(
            f"the module's parameters do not match the checkpoint's layout ({self.layout.size} "
            f"values against {stored.size}): {what}",
            "load the checkpoint into the module class it was trained with",
        )

    def copy(self) -> TorchNetwork:
        """A new network with a copy of the module and of the weights."""
        other = TorchNetwork(copy.deepcopy(self.module), self.input_shape, self.factory, self.loss)
        other.calibrated = self.calibrated
        return other

    def _probe_classes(self) -> int:
        module = self.module
        was = module.training
        module.eval()
        try:
            with torch.no_grad():
                out = module(torch.zeros((2, *self.input_shape), dtype=torch.float32))
        except Exception as exc:
            raise ModelSpecError(
                f"the module {describe_module(module)} fails on images of shape "
                f"(B, {', '.join(map(str, self.input_shape))}): {type(exc).__name__}: {exc}",
                "make its forward take float32 (B, C, H, W) images of the data store",
            ) from None
        finally:
            module.train(was)
        if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 2:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ModelSpecError(
                f"the module {describe_module(module)} returns {shape} for 2 images; expected "
                "logits (2, classes)",
                "return one row of class scores per image",
            )
        return int(out.shape[1])

    def __repr__(self) -> str:
        return describe(self)

    flat = FlatBuffer()

    def weights_assigned(self) -> None:
        """New weights in ``flat``: the running statistics no longer describe them."""
        self.calibrated = False

    @property
    def batch_norm(self) -> bool:
        """Whether the module keeps batch-norm running statistics (inference then needs
        :meth:`calibrate` after the weights change)."""
        return any(is_bn(m) for m in self.module.modules())

    def state_dict(self) -> dict[str, Any]:
        """The trained weights (and buffers) as a PyTorch ``state_dict`` of copies, for
        ``module.load_state_dict``."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    # -- input checks (model/checks.py, as the numba engine's) -------------------------------------

    def check_input(self, x) -> np.ndarray:
        """``x`` as a C-contiguous float32 (B, C, H, W) array, or :class:`InputShapeError`."""
        return checks.check_input(x, self.input_shape)

    def check_labels(self, y, n: int) -> np.ndarray:
        """``y`` as int64 (n,) in [0, classes), or :class:`InputShapeError`."""
        return checks.check_labels(y, n, self.classes)

    def as_images(self, x) -> np.ndarray:
        """Images of any common form as float32 (N, C, H, W) (uint8 scaled by 1/255)."""
        return checks.as_images(x, self.input_shape)

    # -- training -------------------------------------------------------------------------------

    def context(self, batch_size: int) -> TorchContext:
        """A Hogwild thread's module copy and gradient buffer (one per thread)."""
        return TorchContext(self, batch_size)

    def step_into(
        self,
        ctx: TorchContext,
        x: np.ndarray,
        y: np.ndarray,
        n: int | None,
        lr: float,
        momentum: float,
        velocity: np.ndarray,
        acc: np.ndarray | None = None,
        dense_terms: dict | None = None,
    ) -> float:
        """One SGD step on ``x[:n]``, ``y[:n]``: the module's forward, the loss, backward
        into ``ctx.grad`` (a flat float32 buffer), then ``flat += u`` (and ``acc += u``),
        ``u = momentum * velocity - lr * grad`` by the numba engine's kernel, which zeroes
        ``ctx.grad`` again. Returns the mean loss. ``dense_terms`` (the numba engine's
        dense-layer offload) is not supported and must be None; the other arguments are checked
        as the numba engine's are (:func:`~adam_dask.model.checks.check_step`)."""
        if dense_terms is not None:
            raise ModelSpecError(
                "the dense-layer offload needs the numba engine", "set offload_dense=False"
            )
        n, acc = checks.check_step(self, ctx, x, y, n, momentum, velocity, acc)
        if not getattr(_threads, "one", False):
            torch.set_num_threads(1)  # the replica's parallelism is its Hogwild threads
            _threads.one = True
        logits = ctx.module(tensor(x[:n]))
        loss = self._loss(logits, tensor(y[:n]))
        loss.backward()
        sgd_update_into(self._flat, acc, ctx.grad, velocity, lr, momentum)
        return float(loss.detach())

    # -- inference ----------------------------------------------------------------------------------

    def forward(self, x, batch_size: int = 256) -> np.ndarray:
        """Logits (B, classes) float32 of images ``x`` (B, C, H, W) float32, the module in
        evaluation mode."""
        x = self.check_input(x)
        if self.batch_norm and not self.calibrated:
            raise ModelSpecError(
                "the module's batch-norm running statistics do not describe its weights "
                "(just assigned)",
                "call net.calibrate(training_images) before inference",
            )
        module = self.module
        was = module.training
        module.eval()
        out = np.empty((x.shape[0], self.classes), np.float32)
        try:
            with torch.no_grad():
                for s in range(0, x.shape[0], int(batch_size)):
                    chunk = tensor(x[s : s + int(batch_size)])
                    out[s : s + len(chunk)] = module(chunk).numpy()
        finally:
            module.train(was)
        return out

    def predict(self, x, batch_size: int = 256) -> np.ndarray:
        """Class labels (B,) int64 of images ``x`` (any form :meth:`as_images` accepts)."""
        return predict(self, x, batch_size)

    def evaluate(self, x, y, batch_size: int = 256) -> float:
        """Accuracy in [0, 1] on images ``x`` with labels ``y`` (N,)."""
        return accuracy(self, x, y, batch_size)

    def calibrate(self, x, batch_size: int = 256) -> None:
        """Recompute the batch-norm running statistics from images ``x`` (training images,
        unaugmented) on the current weights: each layer's cumulative mean and variance over
        the batches of a forward pass in training mode (nothing to do without batch norm)."""
        if not self.batch_norm:
            return
        x = self.as_images(x)
        module = self.module
        bns: list[Any] = [m for m in module.modules() if is_bn(m)]
        momenta = [m.momentum for m in bns]
        was = module.training
        try:
            for m in bns:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over the batches
            module.train()
            with torch.no_grad():
                for s in range(0, x.shape[0], int(batch_size)):
                    module(tensor(x[s : s + int(batch_size)]))
        finally:
            for m, mom in zip(bns, momenta):
                m.momentum = mom
            module.train(was)
        self.calibrated = True
