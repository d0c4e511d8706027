"""The start-up of a training job, one path for ``adam-dask train`` and ``pipelines/train.py``.

A job describes what it was asked in a :class:`Start`; then

1. :func:`check` refuses bad input before any cluster starts (in a second, not after a
   start-up): contradicting flags, the dataset store, the model (built as the Trainer builds it,
   :func:`~adam_dask.train._settings.network_for`: a spec for the numba engine, a
   ``package.module:factory`` for the torch engine), the checkpoint to resume or not to
   overwrite;
2. :func:`connect` starts or reaches the cluster, an embedded or gateway one sized for what was
   asked (:func:`train_workers`: every partition of every replica needs a TRAIN worker);
3. :func:`open_trainer` makes the :class:`~adam_dask.train.trainer.Trainer`, new or resumed.

>>> import dask
>>> with dask.config.set({"adam.cluster.trainers": 1}):
...     train_workers(None, None, 2), train_workers(None, 3, 2), train_workers(5, None, 2)
(2, 6, 5)
>>> train_workers(None, None, 1) is None  # one partition: the configured count
True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .. import config
from ..errors import CheckpointError, ConfigError, DestinationExistsError

logger = logging.getLogger(__name__)

__all__ = ["Start", "check", "connect", "open_trainer", "train_workers"]


@dataclass
class Start:
    """What a training job was asked: the store, the run's checkpoint, the model, and where
    it runs. ``None`` is "not given" (the configuration's default, or the resumed run's)."""

    data: str
    checkpoint: str | None = None
    resume: bool = False
    overwrite: bool = False
    no_checkpoint: bool = False
    model: str | None = None
    storage_options: dict | None = None
    seed: int | None = None
    replicas: int | None = None
    partitions: int | None = None
    scheduler: str | None = None
    gateway: str | None = None
    tls: bool | None = None
    ps_nodes: int | None = None
    data_nodes: int | None = None
    trainers: int | None = None
    threads: int | None = None


def _same_model(given: str, stored: dict) -> bool:
    """Whether the ``--model`` given names the model a checkpoint's manifest describes."""
    from ..model.engines import TORCH

    if stored.get("engine") == TORCH:
        return stored.get("factory") == given.strip()
    norm = ",".join(t.strip().lower() for t in given.split(","))
    return stored.get("spec") == norm


def check(s: Start) -> None:
    """Every check that needs no cluster; raises an :class:`~adam_dask.errors.AdamError`
    (one ``error:`` line in a job) for bad input."""
    from ..data.datasets import open_split
    from ..ps.checkpoint import read_manifest
    from ._settings import network_for

    if s.resume and not s.checkpoint:
        raise ConfigError(
            "--resume needs --checkpoint URL",
            "give the checkpoint to continue (a run's folder, printed when it started)",
        )
    if s.no_checkpoint and (s.checkpoint or s.overwrite):
        raise ConfigError(
            "--no-checkpoint contradicts --checkpoint and --overwrite", "drop one of them"
        )
    if s.resume and s.overwrite:
        raise ConfigError(
            "--resume and --overwrite contradict each other",
            "continue the run with --resume, or start afresh with --overwrite",
        )
    split = open_split(s.data, "train", s.storage_options)
    if s.resume:
        assert s.checkpoint is not None
        manifest = read_manifest(s.checkpoint, s.storage_options)  # CheckpointError when none
        stored = (manifest.get("meta") or {}).get("model") or {}
        if s.model and not _same_model(s.model, stored):
            raise ConfigError(
                f"--model {s.model} is not the network of the run at {s.checkpoint} "
                f"({stored.get('factory') or stored.get('spec')})",
                "drop --model (the checkpoint names its network), or start a new run",
            )
        return
    # the model as the Trainer builds it: a spec (numba) or package.module:factory (torch)
    network_for(s.model, split, s.data, seed=int(config.get("train.seed", s.seed)))
    if s.checkpoint and not s.overwrite:
        try:
            read_manifest(s.checkpoint, s.storage_options)
        except CheckpointError:
            return  # nothing complete there: a new run may write it
        raise DestinationExistsError(
            f"a checkpoint already exists at {s.checkpoint}",
            "continue it with --resume, replace it with --overwrite, or choose another URL",
        )


def train_workers(trainers: int | None, replicas: int | None, partitions: int | None) -> Any:
    """TRAIN workers for a cluster the job starts (embedded or gateway): ``trainers`` when
    given; with ``partitions`` P > 1 (``adam.train.partitions``), P for each replica (``replicas``,
    else ``adam.cluster.trainers``, sized from this machine); else None (the configured count)."""
    from ..cluster import resolve_trainers

    if trainers is not None:
        return trainers
    parts = int(config.get("train.partitions", partitions))
    if parts <= 1:
        return None
    per = replicas if replicas is not None else resolve_trainers(config.get("cluster.trainers"))
    return parts * per


def connect(s: Start) -> Any:
    """The job's Dask client: the scheduler's, a new gateway cluster's, or the embedded
    cluster's (closing it releases what was started)."""
    from ..cluster import client_for

    trainers = train_workers(s.trainers, s.replicas, s.partitions)
    if trainers != s.trainers and not s.scheduler:
        logger.info(
            "the cluster gets %d TRAIN workers: one per partition of each replica", trainers
        )
    client = client_for(
        s.scheduler,
        s.gateway,
        ps_nodes=s.ps_nodes,
        data_nodes=s.data_nodes,
        trainers=trainers,
        trainer_threads=s.threads,
        tls=s.tls,
    )
    assert client is not None  # the embedded cluster is the default
    return client


def open_trainer(s: Start, client: Any, **settings: Any) -> Any:
    """The Trainer of the job: the run at ``s.checkpoint`` resumed, or a new one. ``settings``
    are the Trainer's keywords (None: not given, the configured or the resumed run's own)."""
    from .trainer import Trainer

    kw = {k: v for k, v in settings.items() if v is not None}
    for name in ("replicas", "partitions", "seed", "threads"):
        value = getattr(s, name)
        if value is not None:
            kw[name] = value
    if s.resume:
        assert s.checkpoint is not None
        return Trainer.resume(s.checkpoint, s.data, client, storage_options=s.storage_options, **kw)
    return Trainer(
        s.data,
        model=s.model,
        client=client,
        checkpoint=False if s.no_checkpoint else s.checkpoint,
        storage_options=s.storage_options,
        overwrite=s.overwrite,
        **kw,
    )
