"""The training driver: epochs, the epoch quorum, validation, metrics, progress and checkpoints.

Usage (on a cluster, so not a doctest)::

    trainer = Trainer(data="data/mnist.zarr")
    trainer.fit(epochs=5, target_accuracy=0.99)
    trainer.history.plot()

The Trainer runs on the client (a notebook, the CLI, a pipeline). Each epoch it submits one
long-running task per replica (:func:`~adam_dask.train.task.run_replica`) to the TRAIN workers.
With ``replicas=None`` (``"auto"``, the default) the epoch runs one replica per TRAIN worker
present when it starts, so workers added during a run (gateway scale-up, autoscaling) train
from the next epoch on, and removed ones stop being counted; a replica whose worker dies is
re-run by Dask on another TRAIN worker. The epoch ends when ``epoch_quorum`` of its replicas have
finished their share (paper section 3.2.5): the Trainer then sets the epoch's stop event, the
stragglers stop at once, and the test set is evaluated on the parameter server's weights.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from .. import config
from ..cluster import PS, TRAIN, workers_with_role
from ..errors import ClusterError, ConfigError
from ..model.engines import shipped
from ._average import TailAverage
from ._epoch import async_rate_factor, epoch_record, replica_count, share_sizes
from ._position import applied_images, recorded_replicas
from ._settings import RunSettings, network_for, resolve_augment
from ._submit import run_replicas
from .metrics import History, Progress
from .run_state import (
    EpochCommits,
    far_hosts,
    load_average,
    refuse_existing,
    resumed_state,
    run_folder,
)
from .schedule import Schedule
from .task import PROGRESS_TOPIC, ReplicaJob
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
    push_every, lr, lr_schedule, lr_floor, lr_warmup, lr_replicas, momentum, batch_size, threads : optional
        Training settings (config ``adam.train.*`` / ``adam.cluster.trainer-threads``). The
        learning rate follows ``lr_schedule`` from ``lr`` to ``lr * lr_floor`` over the epochs
        planned by :meth:`fit`, ramping up over the first ``lr_warmup`` epochs
        (:class:`~adam_dask.train.schedule.Schedule`); in an epoch of more than ``lr_replicas``
        asynchronous replicas each steps ``lr_replicas / R`` as far (:meth:`schedule_for`).
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
            momentum=momentum,
            batch_size=batch_size,
            threads=threads,
            seed=seed,
            epoch_quorum=epoch_quorum,
            offload_dense=offload_dense,
            average_from=average_from,
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
            self._warn_if_nothing_to_offload()

        self._own_client = client is None
        self.client = client
        self.history = History(metrics_out)
        self.epoch = 0
        self.epochs: int | None = None  # the run's planned total, set by fit (or a checkpoint)
        self.server: Any = None
        self.dataservice: Any = None
        self.seconds_to_target: float | None = None
        self._progress_state: dict[int, int] = {}  # replica -> images drawn this epoch
        self.replica_workers: dict[int, str] = {}  # replica -> its worker, this epoch
        self._lock = threading.Lock()
        self._bar: Progress | None = None
        self._commits: EpochCommits | None = None  # the epochs' ends, written in the background

    def _warn_if_nothing_to_offload(self) -> None:
        from .replica import profitable_offload

        if not profitable_offload(self.net, self.settings.push_every):
            logger.warning(
                "offload_dense: no dense layer of %s qualifies at push_every=%d (a layer "
                "qualifies when push_every x (inputs + outputs) < inputs x outputs), so every "
                "layer sends its weight delta; raise the layer widths or lower push_every",
                self.net.spec,
                self.settings.push_every,
            )

    # -- settings ---------------------------------------------------------------------------------

    mode = property(lambda self: self.settings.mode, doc="'async' or 'sync'")
    lr = property(lambda self: self.settings.lr, doc="the learning rate at the start")
    push_every = property(lambda self: self.settings.push_every, doc="images between pushes")
    epoch_quorum = property(lambda self: self.settings.epoch_quorum, doc="ends an epoch")

    @property
    def schedule(self) -> Schedule:
        """The learning-rate schedule over the planned epochs."""
        s = self.settings
        return Schedule(s.lr, self._planned(), s.lr_schedule, s.lr_floor, s.lr_warmup)

    def schedule_for(self, replicas: int) -> Schedule:
        """The schedule each replica of an epoch of ``replicas`` follows: :attr:`schedule`, its
        rates scaled down past ``lr_replicas`` asynchronous replicas (see ``async_rate_factor``)."""
        s = self.settings
        return self.schedule.scaled(async_rate_factor(s.mode, replicas, s.lr_replicas))

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
        if self.client is None:
            from ..cluster import local

            self.client = local()
        self.client.subscribe_topic(PROGRESS_TOPIC, self._on_progress)
        if not workers_with_role(self.client, PS):
            raise ClusterError(
                "the cluster has no PS workers",
                "start workers with --resources PS=1 or use assign_roles",
            )
        self._replicas_now = self._replica_count()
        self.check_partitions()  # before anything starts: refuses what does not fit
        if self.server is None:
            from ..ps.client.server import ParameterServer

            self.server = ParameterServer.create(
                self.client,
                layout=self.net.layout,
                init=self.net.flat,
                shard_bytes=self.shard_bytes,
                checkpoint=self.checkpoint,
                storage_options=self.storage_options,
                meta=self._meta(),
            )
        if self.checkpoint and self._commits is None:
            self._commits = EpochCommits(self.server, self.checkpoint, self.storage_options)
            logger.info("checkpoint: %s", self._shown_checkpoint())
            far = far_hosts(self.checkpoint, workers_with_role(self.client, PS))
            if far:
                logger.warning(
                    "the checkpoint %s is a local path but PS workers run on %s: each writes "
                    "to its own disk; give a URL they all reach (checkpoint=, "
                    "adam.train.runs-dir: s3://...)",
                    self.checkpoint,
                    ", ".join(far),
                )
        if self.dataservice is None:
            from ..data.serving import DataService

            self.dataservice = DataService.create(
                self.client,
                self.data_url,
                split="train",
                storage_options=self.storage_options,
                augment=self.augment,
                seed=self.settings.seed,
                batch_size=self.settings.stream_batch,
            )

    def check_partitions(self) -> Any:
        """The partition plan of the model for this cluster's TRAIN workers
        (:class:`~adam_dask.model.partition.PartitionPlan`), computed once and checked:
        :class:`~adam_dask.errors.PartitionError` names a partition that does not fit its
        worker's memory. :meth:`fit` calls it before anything starts."""
        if self.partition_plan is None:
            from ._partition_task import cluster_plan

            if self.client is None:
                from ..cluster import local

                self.client = local()
            self.partition_plan = cluster_plan(
                self.client, self.net, self.settings, self.partitions
            )
        return self.partition_plan

    def _meta(self) -> dict:
        return {
            "model": self.net.to_dict(),
            "data": self.data_url,
            "mode": self.mode,
            "lr": self.lr,
            "push_every": self.push_every,
            "run": self.run_id,
            "settings": self.settings.to_dict(),
            "partitions": self.partitions,
            "partition_plan": (
                self.partition_plan.as_dict()
                if self.partition_plan is not None and self.partitions > 1
                else None
            ),
            "epochs": self.epochs,
        }

    # -- progress ---------------------------------------------------------------------------------

    def _on_progress(self, event) -> None:
        _, msg = event
        if msg.get("run") != self.run_id or msg.get("epoch") != self.epoch:
            return
        with self._lock:
            self._progress_state[msg["replica"]] = msg["images"]
            self.replica_workers[msg["replica"]] = msg.get("worker")
            total = sum(self._progress_state.values())
        if self._bar is not None:
            self._bar.update_to(total)

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
            logger.info(
                "epoch %d: loss %.4f, test accuracy %.4f, %.0f images/s, %d replicas",
                record["epoch"],
                record["loss"],
                record["test_accuracy"],
                record["images_per_second"],
                record["replicas"],
            )
            if record["test_accuracy"] <= 1.5 / self.num_classes:
                logger.warning(
                    "epoch %d: test accuracy %.3f is at chance level: the model has "
                    "stopped learning (diverged?); lower the learning rate (lr=%g) "
                    "or push_every, or use fewer replicas",
                    record["epoch"],
                    record["test_accuracy"],
                    self.lr,
                )
            self.epoch += 1
            if target_accuracy is not None and record["test_accuracy"] >= target_accuracy:
                self.seconds_to_target = time.perf_counter() - t_start
                break
            if max_seconds is not None and time.perf_counter() - t_start >= max_seconds:
                break
        self._caught_up(f"epoch {self.epoch - 1}, the last trained")
        return self.history

    def _jobs(self, epoch: int, R: int) -> list[ReplicaJob]:
        model, schedule = shipped(self.net), self.schedule_for(R)
        shares = share_sizes(len(self.train_split), R)
        return [
            ReplicaJob(
                run_id=self.run_id,
                replica=i,
                replicas=R,
                epoch=epoch,
                model=model,
                settings=self.settings,
                schedule=schedule,
                share_images=shares[i],
                delay=float(self.slow_replicas.get(i, 0.0)),
            )
            for i in range(R)
        ]

    def _run_epoch(self) -> dict:
        epoch = self.epoch
        R = self._replicas_now = self._epoch_replicas(epoch)
        self._progress_state, self.replica_workers = {}, {}
        self._bar = Progress(
            len(self.train_split), desc=f"epoch {epoch + 1}", enabled=self.progress
        )
        ps_before = self._ps_stats()
        try:
            if self.partitions > 1:
                from ._partition_task import run_partitioned

                run = run_partitioned(
                    self.client,
                    self._jobs(epoch, R),
                    server=self.server,
                    data=self.dataservice,
                    quorum=self.epoch_quorum,
                    bounds=self.partition_plan.bounds(),
                    window=self.partition_plan.window,
                )
            else:
                run = run_replicas(
                    self.client,
                    self._jobs(epoch, R),
                    server=self.server,
                    data=self.dataservice,
                    quorum=self.epoch_quorum,
                )
        finally:
            self._bar.close()
            self._bar = None
        flush_t = time.perf_counter()
        # the copies, not the checkpoint: storage never holds training up (_commit writes it)
        self.server.flush(copies_only=True)
        flush_seconds = time.perf_counter() - flush_t
        images_applied = applied_images(self.server.marks(epoch))
        accuracy = self.evaluate()
        averaged = self.validation.add_epoch(epoch, self.net, None)
        schedule = self.schedule_for(R)
        record = epoch_record(
            epoch,
            run.results,
            replicas=R,
            seconds=run.seconds,
            quorum_seconds=run.quorum_seconds,
            flush_seconds=flush_seconds,
            accuracy=accuracy,
            ps_before=ps_before,
            ps_after=self._ps_stats(),
            lr=schedule.at(epoch),
            lr_end=schedule.at(epoch + 1),
            mode=self.mode,
            images_applied=images_applied,
        )
        if averaged is not None:
            record["average_accuracy"], record["averaged_epochs"] = averaged
        return record

    @property
    def average(self) -> TailAverage | None:
        """The tail average of the weights (``average_from``), None when it is off."""
        return self.validation.average

    def averaged_network(self):
        """A copy of the network holding the tail average of the weights (``average_from``),
        ready to predict (bn layers calibrated on the training images)."""
        net = self.validation.averaged(self.net)
        self.validation.calibrate(net)
        return net

    def _epoch_replicas(self, epoch: int) -> int:
        """The epoch's replicas: those its data positions name (an epoch resumed midway keeps
        its shares), else a fixed count or one per TRAIN worker present now."""
        recorded = recorded_replicas(self.server.marks(epoch))
        if recorded is not None:
            logger.info("epoch %d resumes with its %d replicas", epoch, recorded)
            return recorded
        return self._replica_count()

    def _replica_count(self) -> int:
        """A fixed count, or one per TRAIN worker (per ``partitions`` of them) present now."""
        workers = len(self._train_workers())
        if self.partitions > 1:
            from ._pipeline import check_parts

            R = replica_count(self._fixed_replicas, max(1, workers // self.partitions))
            check_parts(self.partitions, workers, R)
            return R
        return replica_count(self._fixed_replicas, workers)

    def _train_workers(self) -> list[str]:
        """The TRAIN workers, waiting up to ``adam.cluster.start-timeout`` while there are none:
        a TRAIN worker killed at an epoch's start is being replaced by its nanny (seconds)."""
        deadline = time.monotonic() + float(config.get("cluster.start-timeout"))
        while not (found := workers_with_role(self.client, TRAIN)) and time.monotonic() < deadline:
            time.sleep(0.25)
        return found

    def _ps_stats(self) -> dict:
        try:
            return self.server.stats()
        except Exception:  # statistics never fail a run
            logger.debug("PS statistics unavailable", exc_info=True)
            return {}

    def _commit(self, epoch: int) -> None:
        """Have the checkpoint catch up with the end of ``epoch`` in the background: its
        manifest, the history, the weight average (:class:`EpochCommits`)."""
        if self._commits is not None:
            self._commits.submit(epoch, self._meta(), self.history.records, self.average)
            self._commits.watch()  # storage out: said now, not when the commit times out

    def _caught_up(self, what: str) -> None:
        """Wait for the checkpoint to hold every epoch committed (``adam.ps.flush-timeout``),
        saying once that it waits when storage is out; :class:`StorageError` naming storage
        when it does not."""
        commits = self._commits
        if commits is None:
            return
        timeout = float(config.get("ps.flush-timeout"))
        deadline = time.monotonic() + timeout
        pause = float(config.get("ps.retry-max"))
        said = False
        while not commits.wait(max(min(pause, deadline - time.monotonic()), 0.0)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise commits.failure(what)
            commits.watch()  # an outage that began in the last epoch is said here
            if commits.error is not None and not said:
                said = True
                logger.warning(
                    "waiting up to %.0fs more for storage %s to take the checkpoint of %s",
                    left,
                    self._shown_checkpoint(),
                    what,
                )

    def _shown_checkpoint(self) -> str:
        from ..storage import redact_url

        return redact_url(str(self.checkpoint))

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
        from ..ps.client.server import ParameterServer

        own = client is None
        if own:
            from ..cluster import local

            client = local()
        try:
            server = ParameterServer.restore(client, checkpoint, storage_options=storage_options)
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
            if self._commits.pending and self._commits.error is None:
                self._commits.wait(float(config.get("ps.flush-timeout")))
            if self._commits.pending:
                logger.warning("%s", self._commits.failure("the last epoch trained").message)
            self._commits.close()
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
