"""The training driver: epochs, the epoch quorum, validation, metrics, progress and checkpoints.

Usage (on a cluster, so not a doctest)::

    trainer = Trainer(data="data/mnist.zarr")
    trainer.fit(epochs=5, target_accuracy=0.99); trainer.history.plot()

The Trainer runs on the client (a notebook, the CLI, a pipeline). Each epoch it submits one
long-running task per replica (per partition of it: :mod:`._submit`) to the TRAIN workers:
with ``replicas=None`` (the default) one per TRAIN worker present when it starts (workers added
in a run train from the next epoch on); a replica whose worker dies is re-run elsewhere. The
epoch ends when ``epoch_quorum`` of its replicas have
finished their share (paper section 3.2.5): the Trainer then sets the epoch's stop event, the
stragglers stop at once, and the test set is evaluated on the parameter server's weights.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from .. import config
from ..errors import ConfigError
from ._epoch import say_epoch
from ._epoch_run import epoch_replicas, replica_jobs, replicas_now, run_epoch, train_threads
from ._handle import TrainerServer
from ._partition_task import cluster_plan
from ._services import connect, require_ps, restore_server, start_data, start_server
from ._settings import RunSettings, network_for, resolve_augment, warn_if_nothing_to_offload
from .metrics import EpochProgress, History
from .run_state import (
    EpochCommits,
    load_average,
    refuse_existing,
    resumed_state,
    run_folder,
    run_meta,
    start_commits,
)
from .schedule import Schedule
from .streams import StreamPlan, describe, plan_epoch, resolve_push_every
from .task import PROGRESS_TOPIC
from .validation import Validation

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """Project Adam's asynchronous (or synchronous) data-parallel training on a Dask cluster.

    Parameters
    ----------
    data : str
        URL of a dataset store written by ``adam-dask ingest`` (``train`` split for training,
        ``test`` for validation).
    model : str, Network, nn.Module or callable, optional
        A network spec (config ``adam.model.spec``, the paper's MNIST network) or a Network
        (the numba engine); or a PyTorch ``nn.Module``, a zero-argument callable returning one,
        or ``"package.module:factory"`` (the torch engine,
        :class:`~adam_dask.model.torch_engine.TorchNetwork`).
    loss : callable, optional
        The torch engine's loss, ``loss(logits, labels)`` -> the batch's mean (default
        cross-entropy).
    client : distributed.Client, optional
        The cluster to run on. ``None`` starts the embedded cluster (:func:`adam_dask.cluster.local`)
        and closes it when :meth:`close` is called (or the Trainer leaves a ``with`` block).
    replicas : int or "auto", optional
        Model replicas per epoch (config ``adam.train.replicas``); ``None``/``"auto"``: one per
        TRAIN worker present at each epoch's start.
    mode : {"async", "sync"}
        Asynchronous Adam training, or the synchronous baseline (every step waits for all
        replicas and applies their averaged update).
    push_every, lr, lr_schedule, lr_floor, lr_warmup, lr_streams, lr_replicas, momentum, batch_size, threads, server_optimizer : optional
        Training settings (config ``adam.train.*`` / ``adam.cluster.trainer-threads``). The
        learning rate follows ``lr_schedule`` from ``lr`` to ``lr * lr_floor`` over the epochs
        planned by :meth:`fit`, ramping up over the first ``lr_warmup`` epochs
        (:class:`~adam_dask.train.schedule.Schedule`); past ``lr_streams`` threads of an
        async replica each steps ``lr_streams / T`` as far (and ``sqrt(2 / R)`` past 2 replicas), and ``push_every`` and ``lr_warmup``
        follow the replicas when ``auto`` (:mod:`adam_dask.train.streams`).
        ``server_optimizer`` (``adam.ps.optimizer``): what the parameter server does with a
        push, ``"sum"``, ``"nesterov"``, either ``+staleness`` (``adam_dask.ps.protocol.optimizer``).
    augment : bool or Augment, optional
        Augmentation on the data servers (config ``adam.augment``).
    checkpoint : str or False, optional
        URL where the parameter server writes back its shards and manifest (and the history).
        ``None`` (the default): a new run folder under ``adam.train.runs-dir`` (``runs/`` in
        the current directory, as Lightning's ``lightning_logs/``), so a run survives the loss
        of every copy of a shard and can be resumed; ``False``: no checkpoint. The URL is
        :attr:`checkpoint`. An existing checkpoint is refused unless ``overwrite=True``;
        continue one with :meth:`resume`. The epochs' ends are written to it in the
        background: a storage outage pauses the write-back, never training.
    epoch_quorum : float, optional
        Fraction of replicas whose end ends an epoch (config ``adam.train.epoch-quorum``);
        forced to 1.0 in sync mode.
    metrics_out : str, optional
        A JSONL file that receives one record per epoch.
    progress : bool
        Show a tqdm progress bar (a widget in notebooks).
    offload_dense : bool, optional
        The paper's dense-layer offload: for the dense layers where it saves bytes
        (``k * (in + out) < in * out``), replicas send activations and error terms and the
        parameter server computes the weight update (config ``adam.train.offload-dense``).
    average_from : float, optional
        Tail averaging (config ``adam.train.average-from``, off by default): from this fraction
        of the planned epochs on, the mean of the parameter server's end-of-epoch weights is
        validated too (``average_accuracy`` in the history) and returned by
        :meth:`averaged_network`; training itself is unchanged.
    partitions : int, optional
        TRAIN workers each model replica spans (config ``adam.train.partitions``, default 1):
        consecutive layers per worker, a dense layer too wide for one split by output neurons
        (paper 3.2, Figure 6). The plan (:attr:`partition_plan`) is checked against the TRAIN
        workers' memory before anything starts; see docs/design.md, "Model partitioning".
    slow_replicas : dict, optional
        ``{replica: seconds per batch}``: deliberately slowed replicas, for straggler
        experiments (``benchmarks/quorum.py``).
    """

    def __init__(
        self,
        data: str,
        model=None,
        client=None,
        *,
        replicas: int | str | None = None,
        mode: str | None = None,
        push_every: int | None = None,
        lr: float | None = None,
        lr_schedule: str | None = None,
        lr_floor: float | None = None,
        lr_warmup: float | None = None,
        lr_replicas: int | None = None,
        lr_streams: int | None = None,
        momentum: float | None = None,
        batch_size: int | None = None,
        threads: int | None = None,
        augment=None,
        checkpoint: str | bool | None = None,
        epoch_quorum: float | None = None,
        storage_options: dict | None = None,
        metrics_out: str | None = None,
        progress: bool = True,
        seed: int | None = None,
        slow_replicas: dict[int, float] | None = None,
        shard_bytes: int | None = None,
        offload_dense: bool | None = None,
        average_from: float | None = None,
        overwrite: bool = False,
        loss=None,
        partitions: int | None = None,
        server_optimizer: str | None = None,
    ):
        from ..data.datasets import open_split

        self.data_url = data
        self.storage_options = storage_options
        self.settings = RunSettings.resolve(
            mode=mode,
            push_every=push_every,
            lr=lr,
            lr_schedule=lr_schedule,
            lr_floor=lr_floor,
            lr_warmup=lr_warmup,
            lr_replicas=lr_replicas,
            lr_streams=lr_streams,
            momentum=momentum,
            batch_size=batch_size,
            threads=threads,
            seed=seed,
            epoch_quorum=epoch_quorum,
            offload_dense=offload_dense,
            average_from=average_from,
            server_optimizer=server_optimizer,
        )
        self.run_id = uuid.uuid4().hex[:8]
        self.checkpoint = run_folder(checkpoint, self.run_id)
        if checkpoint and self.checkpoint and not overwrite:
            refuse_existing(self.checkpoint, storage_options)
        self.progress = progress
        self.slow_replicas = dict(slow_replicas or {})
        self.shard_bytes = shard_bytes
        self.augment = resolve_augment(augment)
        self._fixed_replicas: int | None = None
        self._replicas_now: int | None = None
        self.set_replicas(config.get("train.replicas", replicas))
        self.partitions = int(config.get("train.partitions", partitions))
        if self.partitions < 1:
            raise ConfigError(
                f"partitions={self.partitions}", "use at least 1 (adam.train.partitions)"
            )
        self.partition_plan: Any = None

        self.train_split = open_split(data, "train", storage_options)
        self.validation = Validation(data, self.train_split, storage_options)
        self.net = network_for(model, self.train_split, data, self.settings.seed, loss)
        self.num_classes = self.train_split.num_classes
        if self.settings.offload_dense and self.settings.mode == "async":
            warn_if_nothing_to_offload(self.net, resolve_push_every(self.settings.push_every, 1))
        self._plan: StreamPlan | None = None  # the newest epoch's (streams.stream_plan)

        self._own_client = client is None
        self.client = client
        self.history = History(metrics_out)
        self.epoch = 0
        self.epochs: int | None = None  # the run's planned total, set by fit (or a checkpoint)
        self.server: TrainerServer | None = None
        self.dataservice: Any = None
        self.seconds_to_target: float | None = None
        self._progress = EpochProgress(self.run_id)
        self._progress_state = self._progress.images  # replica -> images drawn this epoch
        self.replica_workers = self._progress.workers  # replica -> its worker, this epoch
        self._commits: EpochCommits | None = None  # the epochs' ends, written in the background

    # -- settings ---------------------------------------------------------------------------------

    mode = property(lambda self: self.settings.mode, doc="'async' or 'sync'")
    lr = property(lambda self: self.settings.lr, doc="the learning rate at the start")

    push_every = property(
        lambda self: (self._plan or self.settings).push_every,
        doc="images between pushes: the newest epoch's (None before the first of an auto one)",
    )

    epoch_quorum = property(lambda self: self.settings.epoch_quorum, doc="ends an epoch")

    @property
    def schedule(self) -> Schedule:
        """One stream's rate over the planned epochs (:meth:`plan_for` shares it)."""
        s = self.settings
        return Schedule(s.lr, self._planned(), s.lr_schedule, s.lr_floor, s.lr_warmup or 0.0)

    def plan_for(self, replicas: int) -> StreamPlan:
        """How an epoch of ``replicas`` trains (:func:`~.streams.plan_epoch`): each stream's
        rate, the push period and the warm-up, for the threads a replica has; logged when new."""
        s = self.settings
        threads = 1 if s.mode == "sync" else (s.threads or train_threads(self.client))
        plan = plan_epoch(s, replicas, threads)
        if plan != self._plan:
            logger.info("epoch %d: %s", self.epoch, describe(plan))
        self._plan = plan
        return plan

    def _planned(self, epochs: int | None = None) -> int:
        return int(config.get("train.epochs", epochs if epochs is not None else self.epochs))

    def set_replicas(self, n: int | str | None) -> None:
        """A fixed number of replicas, or ``None`` / ``"auto"``: one per TRAIN worker present at
        each epoch's start."""
        if n is None or n == "auto":
            self._fixed_replicas = None
            return
        if isinstance(n, str) or int(n) < 1:
            raise ConfigError(f"replicas={n!r}", "use at least one replica, or 'auto'")
        self._fixed_replicas = int(n)

    @property
    def replicas(self) -> int | None:
        """The replicas of the current (or last) epoch; before the first, a fixed count or None."""
        return self._replicas_now or self._fixed_replicas

    # -- set-up ---------------------------------------------------------------------------------

    def _start(self) -> None:
        self.client = connect(self.client)
        self.client.subscribe_topic(PROGRESS_TOPIC, self._progress.on_event)
        ps_workers = require_ps(self.client)
        self._replicas_now = replicas_now(self.client, self._fixed_replicas, self.partitions)
        self.check_partitions()  # before anything starts: refuses what does not fit
        if self.server is None:
            self.server = start_server(
                self.client,
                self.net,
                shard_bytes=self.shard_bytes,
                checkpoint=self.checkpoint,
                storage_options=self.storage_options,
                meta=self._meta(),
                optimizer=self.settings.server_optimizer,
            )
        if self.checkpoint and self._commits is None:
            self._commits = start_commits(
                self.server, self.checkpoint, self.storage_options, ps_workers
            )
        if self.dataservice is None:
            self.dataservice = start_data(
                self.client,
                self.data_url,
                storage_options=self.storage_options,
                augment=self.augment,
                settings=self.settings,
            )

    def check_partitions(self) -> Any:
        """The partition plan of the model for this cluster's TRAIN workers
        (:class:`~adam_dask.model.partition.PartitionPlan`), computed once and checked:
        :class:`~adam_dask.errors.PartitionError` names a partition that does not fit its
        worker's memory. :meth:`fit` calls it before anything starts."""
        if self.partition_plan is None:
            self.client = connect(self.client)
            self.partition_plan = cluster_plan(
                self.client, self.net, self.settings, self.partitions
            )
        return self.partition_plan

    def _meta(self) -> dict:
        return run_meta(self)

    # -- training ---------------------------------------------------------------------------------

    def fit(
        self,
        epochs: int | None = None,
        target_accuracy: float | None = None,
        max_seconds: float | None = None,
    ) -> History:
        """Train until the run has ``epochs`` epochs in all (config ``adam.train.epochs``; a
        resumed run counts the epochs it already has, as Keras's ``epochs`` with
        ``initial_epoch``), or until ``target_accuracy`` or ``max_seconds``.

        ``epochs`` is also the plan the learning-rate schedule anneals over. Returns the
        :attr:`history`; ``self.seconds_to_target`` holds the wall seconds from the start of
        ``fit`` to the end of the first epoch at or above ``target_accuracy``.
        """
        self.epochs = self._planned(epochs)
        self.validation.plan_average(self.settings.average_from, self.epochs)
        self._start()
        t_start = time.perf_counter()
        self.seconds_to_target = None
        if self.epoch >= self.epochs:
            logger.info("the run already has %d of %d epochs", self.epoch, self.epochs)
        while self.epoch < self.epochs:
            record = self._run_epoch()
            record["wall_seconds"] = round(time.perf_counter() - t_start, 3)
            self.history.append(record)
            self._commit(record["epoch"])
            say_epoch(record, self.num_classes, self.lr)
            self.epoch += 1
            if target_accuracy is not None and record["test_accuracy"] >= target_accuracy:
                self.seconds_to_target = time.perf_counter() - t_start
                break
            if max_seconds is not None and time.perf_counter() - t_start >= max_seconds:
                break
        self._caught_up(f"epoch {self.epoch - 1}, the last trained")
        return self.history

    def _run_epoch(self) -> dict:
        epoch, server = self.epoch, self.server
        assert server is not None, "fit() starts the parameter server first"
        R = self._replicas_now = epoch_replicas(
            self.client, server, epoch, self._fixed_replicas, self.partitions
        )
        plan = self.plan_for(R)
        jobs = replica_jobs(
            self.run_id,
            epoch,
            R,
            net=self.net,
            settings=replace(self.settings, push_every=plan.push_every),
            schedule=plan.applied(self.schedule),
            images=len(self.train_split),
            slow=self.slow_replicas,
            partition_plan=self.check_partitions(),
        )
        self._progress.begin(epoch, len(self.train_split), self.progress)
        try:
            record = run_epoch(
                self.client,
                jobs,
                server=server,
                data=self.dataservice,
                quorum=self.epoch_quorum,
                evaluate=self.evaluate,
            )
        finally:
            self._progress.end()
        averaged = self.validation.add_epoch(epoch, self.net, None)
        if averaged is not None:
            record["average_accuracy"], record["averaged_epochs"] = averaged
        return {**record, **plan.as_record()}  # how its streams trained

    average = property(
        lambda self: self.validation.average, doc="the tail average (average_from), or None"
    )

    def averaged_network(self):
        """A copy of the network holding the tail average of the weights (``average_from``),
        ready to predict (bn layers calibrated on the training images)."""
        net = self.validation.averaged(self.net)
        self.validation.calibrate(net)
        return net

    def _commit(self, epoch: int) -> None:
        """Have the checkpoint catch up with the end of ``epoch`` in the background: its
        manifest, the history, the weight average (:class:`EpochCommits`)."""
        if self._commits is not None:
            self._commits.submit(epoch, self._meta(), self.history.records, self.average)
            self._commits.watch()  # storage out: said now, not when the commit times out

    def _caught_up(self, what: str) -> None:
        """Wait for the checkpoint to hold every epoch committed (:meth:`EpochCommits.caught_up`)."""
        if self._commits is not None:
            self._commits.caught_up(what)

    # -- evaluation ------------------------------------------------------------------------------

    def evaluate(self, data: str | None = None, split: str = "test") -> float:
        """Top-1 accuracy of the parameter server's current weights on ``data`` (default: the
        training store's test split)."""
        if self.server is not None:
            self.net.flat = self.server.pull()
        return self.validation.accuracy(self.net, data, split)

    # -- lifecycle -------------------------------------------------------------------------------

    def save(self) -> str:
        """Flush every push to the checkpoint (manifest written last); returns its URL."""
        if not self.checkpoint or self.server is None or self._commits is None:
            raise ConfigError(
                "this Trainer has no checkpoint", "pass checkpoint=URL (or leave it the default)"
            )
        self._commit(self.epoch - 1)
        self._caught_up(f"epoch {self.epoch - 1}")
        return self.checkpoint

    @classmethod
    def resume(
        cls,
        checkpoint: str,
        data: str | None = None,
        client=None,
        *,
        storage_options: dict | None = None,
        **kwargs: Any,
    ) -> Trainer:
        """A Trainer that continues the run checkpointed at ``checkpoint``: its weights, epoch,
        history, planned epochs and settings (mode, learning rate and schedule, push_every, ...);
        a keyword given here (not None) replaces the stored setting."""
        own = client is None
        client = connect(client)
        try:
            server = restore_server(client, checkpoint, storage_options, kwargs)
            state = resumed_state(server, checkpoint, data, storage_options, kwargs)
            trainer = cls(
                state.data,
                model=state.net,
                client=client,
                storage_options=storage_options,
                checkpoint=False,  # the one resumed, set below
                **state.settings,
            )
        except BaseException:
            if own:
                client.close()
            raise
        if state.mode and trainer.mode != state.mode:
            logger.warning("resuming a %s run in %s mode, as asked", state.mode, trainer.mode)
        trainer._own_client = own
        trainer.checkpoint = checkpoint
        trainer.server = server
        trainer.history.records = [dict(r) for r in state.records]
        trainer.epoch = state.epoch
        trainer.epochs = state.epochs
        if trainer.settings.average_from is not None:
            trainer.validation.average = load_average(checkpoint, storage_options, state.epoch)
        return trainer

    def close(self) -> None:
        """Release the data servers and the parameter server (after the checkpoint caught up
        with the epochs trained, unless storage is out); close an embedded cluster."""
        if self._commits is not None:
            self._commits.finish("the last epoch trained")
            self._commits = None
        for obj in (self.dataservice, self.server):
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    logger.debug("close failed", exc_info=True)
        self.dataservice = self.server = None
        if self.client is not None:
            try:
                self.client.unsubscribe_topic(PROGRESS_TOPIC)
            except Exception:
                logger.debug("unsubscribe failed", exc_info=True)
        if self._own_client and self.client is not None:
            self.client.close()
            self.client = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plot(self):
        """Loss and accuracy curves of :attr:`history` (matplotlib figure)."""
        return self.history.plot()
