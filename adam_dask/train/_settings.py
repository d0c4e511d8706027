"""A training run's settings, resolved once: keyword, else ``adam.train.*`` / ``adam.cluster.*``.

:class:`RunSettings` is built where the Trainer is built (keyword ``None`` -> config), checked
there, stored in the checkpoint's manifest and read back by :meth:`Trainer.resume`, so a resumed
run keeps its mode, learning rate and schedule unless the caller gives new ones. The replica
tasks receive it inside their :class:`~adam_dask.train.task.ReplicaJob`. Pure: no Dask.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .. import config, sizing
from ..errors import ConfigError
from ..ps.protocol.optimizer import ServerOptimizer
from ._average import check_average_from
from .schedule import KINDS

__all__ = ["MODES", "RunSettings", "network_for", "resolve_augment", "warn_if_nothing_to_offload"]

MODES = ("async", "sync")

# keyword -> config key, for every setting read from adam.yaml
_KEYS = {
    "mode": "train.mode",
    "push_every": "train.push-every",
    "lr": "train.lr",
    "lr_schedule": "train.lr-schedule",
    "lr_floor": "train.lr-floor",
    "lr_warmup": "train.lr-warmup",
    "lr_replicas": "train.lr-replicas",
    "lr_streams": "train.lr-streams",
    "momentum": "train.momentum",
    "batch_size": "train.batch-size",
    "threads": "cluster.trainer-threads",
    "seed": "train.seed",
    "epoch_quorum": "train.epoch-quorum",
    "offload_dense": "train.offload-dense",
    "sync_timeout": "train.sync-timeout",
    "report_interval": "train.report-interval",
    "stream_images": "train.stream-images",
    "average_from": "train.average-from",
    "server_optimizer": "ps.optimizer",
}


@dataclass(frozen=True, slots=True)
class RunSettings:
    """Everything that shapes how the replicas train (not where: data, cluster, checkpoint)."""

    mode: str
    push_every: int | None  # None ("auto"): from the replicas (streams.auto_push_every)
    lr: float
    lr_schedule: str
    lr_floor: float
    lr_warmup: float | None  # epochs the rate ramps up over; None ("auto"): streams.stream_plan
    lr_replicas: int | None  # async, not None: each of R more steps lr * this / R
    momentum: float
    batch_size: int
    threads: int | None  # Hogwild threads per replica; None ("auto"): its TRAIN worker's threads
    seed: int
    epoch_quorum: float
    offload_dense: bool
    sync_timeout: float
    report_interval: float
    stream_images: int | None  # None ("auto"): stream-images-per-thread x a replica's threads
    average_from: float | None  # tail averaging from this fraction of the plan; None: off
    server_optimizer: str = "sum"  # what the PS does with each push (ps.protocol.optimizer)
    lr_streams: int | None = (
        8  # async: past this many threads of a replica each steps lr * this / T
    )

    @classmethod
    def resolve(cls, base: RunSettings | dict | None = None, **given: Any) -> RunSettings:
        """Settings from the keywords ``given`` (None = not given), else ``base`` (a resumed
        run's stored settings), else the configuration; checked."""
        unknown = set(given) - set(_KEYS)
        if unknown:
            raise ConfigError(f"unknown training settings {sorted(unknown)}")
        stored = asdict(base) if isinstance(base, RunSettings) else dict(base or {})
        values = {}
        for f in fields(cls):
            v = given.get(f.name)
            if v is None:
                v = stored.get(f.name)
            values[f.name] = config.get(_KEYS[f.name], v)
        s = cls(
            mode=str(values["mode"]),
            push_every=_count_or_none(
                values["push_every"],
                (sizing.AUTO,),
                "push_every",
                "set push_every= or adam.train.push-every (auto: from the replicas)",
            ),
            lr=float(values["lr"]),
            lr_schedule=str(values["lr_schedule"]),
            lr_floor=float(values["lr_floor"]),
            lr_warmup=None
            if str(values["lr_warmup"]).lower() == sizing.AUTO
            else float(values["lr_warmup"]),
            lr_replicas=_count_or_none(
                values["lr_replicas"],
                _OFF,
                "lr_replicas",
                "set lr_replicas= or adam.train.lr-replicas (null: the rate whatever the replicas)",
            ),
            momentum=float(values["momentum"]),
            batch_size=int(values["batch_size"]),
            # auto: None, each replica runs as many threads as its TRAIN worker has
            threads=_count_or_none(
                values["threads"],
                (sizing.AUTO,),
                "threads",
                "set threads= or adam.cluster.trainer-threads (auto: the TRAIN worker's threads)",
            ),
            seed=int(values["seed"]),
            epoch_quorum=float(values["epoch_quorum"]),
            offload_dense=bool(values["offload_dense"]),
            sync_timeout=float(values["sync_timeout"]),
            report_interval=float(values["report_interval"]),
            stream_images=_count_or_none(
                values["stream_images"],
                (sizing.AUTO,),
                "stream_images",
                "set adam.train.stream-images (auto: from a replica's threads)",
            ),
            average_from=_optional_fraction(values["average_from"]),
            server_optimizer=ServerOptimizer.resolve(values["server_optimizer"]).name,
            lr_streams=_count_or_none(
                values["lr_streams"],
                _OFF,
                "lr_streams",
                "set lr_streams= or adam.train.lr-streams (null: the rate whatever the streams)",
            ),
        )
        s.check()
        if s.mode == "sync" and s.epoch_quorum != 1.0:
            s = replace(s, epoch_quorum=1.0)  # every replica finishes every synchronous step
        return s

    def check(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}", "use 'async' or 'sync'")
        if not 0 < self.epoch_quorum <= 1:
            raise ConfigError(
                f"epoch_quorum={self.epoch_quorum} must lie in (0, 1]",
                "e.g. 0.75 ends an epoch when 3 of 4 replicas are done",
            )
        if (self.push_every is not None and self.push_every < 1) or self.lr <= 0:
            raise ConfigError(
                f"push_every={self.push_every}, lr={self.lr}", "both must be positive"
            )
        if self.lr_schedule not in KINDS:
            raise ConfigError(
                f"lr_schedule={self.lr_schedule!r} is not one of {', '.join(KINDS)}",
                "set lr_schedule= or adam.train.lr-schedule",
            )
        if self.lr_warmup is not None and not (
            math.isfinite(self.lr_warmup) and self.lr_warmup >= 0
        ):
            raise ConfigError(
                f"lr_warmup={self.lr_warmup} must be a number of epochs >= 0",
                "set lr_warmup= or adam.train.lr-warmup (0 for none)",
            )
        if self.offload_dense and self.momentum > 0:
            raise ConfigError(
                "offload_dense needs momentum 0 (the PS applies plain outer-product updates)",
                "set momentum=0 or offload_dense=False",
            )
        if self.average_from is not None:
            check_average_from(self.average_from)
        if self.sync_timeout <= 0:
            raise ConfigError(
                f"sync_timeout={self.sync_timeout} must be positive",
                "set adam.train.sync-timeout",
            )

    def stream_batch(self, threads: int) -> int:
        """Images per batch from the data stream to a replica of ``threads`` threads: a
        multiple of the update mini-batch near ``stream_images``, or where that is ``auto``
        near ``stream-images-per-thread`` x ``threads`` and at least ``stream-images-min``
        (a stream's batches each cost a round trip: more threads, larger batches)."""
        images = self.stream_images
        if images is None:
            per = int(config.get("train.stream-images-per-thread"))
            images = max(int(config.get("train.stream-images-min")), per * max(1, threads))
        return self.batch_size * max(1, images // self.batch_size)

    def to_dict(self) -> dict:
        """JSON-safe, for the checkpoint's manifest."""
        return asdict(self)


_OFF = ("none", "null", "off", "")


def _is_none(v: Any, words: tuple[str, ...] = _OFF) -> bool:
    """``v`` is None or one of ``words`` (a setting left off, or left to the cluster)."""
    return v is None or (isinstance(v, str) and v.strip().lower() in words)


def _count_or_none(v: Any, none: tuple[str, ...], name: str, hint: str) -> int | None:
    """None for None or one of the words ``none``, else a whole number >= 1."""
    if _is_none(v, none):
        return None
    n = int(v)
    if n < 1:
        raise ConfigError(f"{name}={n} must be at least 1", hint)
    return n


def _optional_fraction(v: Any) -> float | None:
    """None for null/"none"/"off" (the setting is off), else the number."""
    return None if _is_none(v) else float(v)


def resolve_augment(augment: Any) -> Any:
    """The data servers' augmentation: an ``Augment``, or None for none; ``True`` builds one
    from ``adam.augment``, ``None`` follows ``adam.augment.enabled``."""
    from ..data import augment as aug

    if augment is None:
        augment = config.get("augment.enabled")
    if augment is True:
        return aug.Augment.from_config()
    if augment is False:
        return None
    return augment


def network_for(model: Any, split: Any, url: str, seed: int, loss: Any = None) -> Any:
    """The Network to train on ``split`` (of the store at ``url``): a copy of ``model`` when it
    is a Network, else one built from the spec ``model`` (config ``adam.model.spec``) with
    ``seed``; a TorchNetwork for an ``nn.Module``, a callable returning one or a factory path
    (:mod:`adam_dask.model.engines`); checked against the images' shape and the number of
    classes. ``loss`` (the torch engine's) is refused for a numba network."""
    from ..model.engines import is_torch_model
    from ..model.network import Network

    if is_torch_model(model):
        from ..model.torch_engine import TorchNetwork

        net: Any = TorchNetwork.build(model, split.input_shape, seed=seed, loss=loss)
    elif loss is not None:
        raise ConfigError(
            "loss= needs a PyTorch model (the numba engine trains softmax cross-entropy)",
            "pass model= an nn.Module, a callable returning one, or package.module:factory",
        )
    elif isinstance(model, Network):
        net = model.copy()
    else:
        spec = config.get("model.spec", model)
        net = Network.from_spec(spec, input_shape=split.input_shape, seed=seed)
    if tuple(net.input_shape) != tuple(split.input_shape):
        raise ConfigError(
            f"the model takes inputs {tuple(net.input_shape)} but {url} "
            f"holds images {split.input_shape}",
            "give a model for these images",
        )
    if net.classes < split.num_classes:
        raise ConfigError(
            f"the model has {net.classes} outputs but {url} has {split.num_classes} classes",
            f"end the model with {split.num_classes} outputs (fc{split.num_classes})",
        )
    return net


def warn_if_nothing_to_offload(net: Any, push_every: int) -> None:
    """Warn when ``offload_dense`` is asked but no dense layer of ``net`` qualifies at
    ``push_every`` (:func:`~adam_dask.model.partition.profitable_offload`)."""
    from ..model.partition import profitable_offload

    if not profitable_offload(net, push_every):
        logging.getLogger(__name__).warning(
            "offload_dense: no dense layer of %s qualifies at push_every=%d (a layer "
            "qualifies when push_every x (inputs + outputs) < inputs x outputs), so every "
            "layer sends its weight delta; raise the layer widths or lower push_every",
            net.spec,
            push_every,
        )
