"""The training driver: epochs, the 75% rule, validation, metrics, progress and checkpoints.

>>> trainer = Trainer(data="data/mnist.zarr", replicas=2)        # doctest: +SKIP
>>> trainer.fit(epochs=5, target_accuracy=0.99)                   # doctest: +SKIP
>>> trainer.history.plot()                                        # doctest: +SKIP

The Trainer runs on the client (a notebook, the CLI, a pipeline). Each epoch it submits one
long-running task per replica (:func:`~adam_dask.train.task.run_replica`) pinned to the TRAIN
workers. The epoch ends when ``epoch_quorum`` of the replicas have finished their share (paper
section 3.2.5): the Trainer then sets the epoch's stop event, the stragglers stop at once, and
the test set is evaluated on the parameter server's current weights.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from typing import Any

import numpy as np

from .. import config
from ..cluster import PS, TRAIN, workers_with_role
from ..errors import ClusterError, ConfigError, DatasetError
from .metrics import History, Progress
from .task import PROGRESS_TOPIC, ReplicaJob, SyncBarrier, run_replica

logger = logging.getLogger(__name__)

MODES = ("async", "sync")


class Trainer:
    """Project Adam's asynchronous (or synchronous) data-parallel training on a Dask cluster.

    Parameters
    ----------
    data : str
        URL of a dataset store written by ``adam-dask ingest`` (``train`` split for training,
        ``test`` for validation).
    model : str or Network, optional
        A network spec (config ``adam.model.spec``, the paper's MNIST network) or a Network.
    client : distributed.Client, optional
        The cluster to run on. ``None`` starts the embedded cluster (:func:`adam_dask.cluster.local`)
        and closes it when :meth:`close` is called (or the Trainer leaves a ``with`` block).
    replicas : int, optional
        Model replicas; default one per TRAIN worker.
    mode : {"async", "sync"}
        Asynchronous Adam training, or the synchronous baseline (every step waits for all
        replicas and applies their averaged update).
    push_every, lr, momentum, lr_decay, batch_size, threads : optional
        Training settings (config ``adam.train.*`` / ``adam.cluster.trainer-threads``).
    augment : bool or Augment, optional
        Augmentation on the data servers (config ``adam.augment``).
    checkpoint : str, optional
        URL where the parameter server writes back its shards and manifest (and the history).
        An existing checkpoint there is refused unless ``overwrite=True``.
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
    slow_replicas : dict, optional
        ``{replica: seconds per batch}``: deliberately slowed replicas, for straggler
        experiments (``benchmarks/time_to_accuracy.py --straggler``).
    """

    def __init__(
        self,
        data: str,
        model=None,
        client=None,
        *,
        replicas: int | None = None,
        mode: str | None = None,
        push_every: int | None = None,
        lr: float | None = None,
        momentum: float | None = None,
        lr_decay: float | None = None,
        batch_size: int | None = None,
        threads: int | None = None,
        augment=None,
        checkpoint: str | None = None,
        epoch_quorum: float | None = None,
        storage_options: dict | None = None,
        metrics_out: str | None = None,
        progress: bool = True,
        seed: int | None = None,
        slow_replicas: dict[int, float] | None = None,
        shard_bytes: int | None = None,
        offload_dense: bool | None = None,
        overwrite: bool = False,
        _server=None,
        _history: History | None = None,
        _first_epoch: int = 0,
    ):
        from ..data.datasets import open_split
        from ..model.network import Network

        self.data_url = data
        self.storage_options = storage_options
        self.mode = config.get("train.mode", mode)
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}", "use 'async' or 'sync'")
        self.push_every = int(config.get("train.push-every", push_every))
        self.lr = float(config.get("train.lr", lr))
        self.momentum = float(config.get("train.momentum", momentum))
        self.lr_decay = float(config.get("train.lr-decay", lr_decay))
        self.batch_size = int(config.get("train.batch-size", batch_size))
        self.threads = int(config.get("cluster.trainer-threads", threads))
        self.seed = int(config.get("train.seed", seed))
        quorum = float(config.get("train.epoch-quorum", epoch_quorum))
        if not 0 < quorum <= 1:
            raise ConfigError(
                f"epoch_quorum={quorum} must lie in (0, 1]",
                "e.g. 0.75 ends an epoch when 3 of 4 replicas are done",
            )
        self.epoch_quorum = 1.0 if self.mode == "sync" else quorum
        if self.push_every < 1 or self.lr <= 0:
            raise ConfigError(
                f"push_every={self.push_every}, lr={self.lr}", "both must be positive"
            )
        self.checkpoint = checkpoint
        if checkpoint and _server is None and not overwrite:
            self._refuse_existing_checkpoint(checkpoint, storage_options)
        self.progress = progress
        self.slow_replicas = dict(slow_replicas or {})
        self.shard_bytes = shard_bytes
        self.offload_dense = bool(config.get("train.offload-dense", offload_dense))
        if self.offload_dense and self.momentum > 0:
            raise ConfigError(
                "offload_dense needs momentum 0 (the PS applies plain outer-product updates)",
                "set momentum=0 or offload_dense=False",
            )
        self.augment = self._augment(augment)
        self._replicas = None
        if replicas is not None:
            self.set_replicas(replicas)

        self.train_split = open_split(data, "train", storage_options)
        try:
            self.test_split = open_split(data, "test", storage_options)
        except DatasetError:
            logger.warning(
                "%s has no test split: validating on the first 10000 training images", data
            )
            self.test_split = None
        if isinstance(model, Network):
            self.net = model.copy()
        else:
            spec = config.get("model.spec", model)
            self.net = Network.from_spec(
                spec, input_shape=self.train_split.input_shape, seed=self.seed
            )
        if tuple(self.net.input_shape) != tuple(self.train_split.input_shape):
            raise ConfigError(
                f"the model takes inputs {tuple(self.net.input_shape)} but {data} "
                f"holds images {self.train_split.input_shape}",
                "give a model spec for these images",
            )
        self.num_classes = self.train_split.num_classes
        if self.net.classes < self.num_classes:
            raise ConfigError(
                f"the model has {self.net.classes} outputs but {data} has "
                f"{self.num_classes} classes",
                f"end the spec with fc{self.num_classes}",
            )

        self._own_client = client is None
        self.client = client
        self.history = _history if _history is not None else History(metrics_out)
        if metrics_out and _history is not None:
            self.history.path = metrics_out
        self.epoch = _first_epoch
        self.run_id = uuid.uuid4().hex[:8]
        self.server = _server
        self.dataservice = None
        self._progress_state: dict[int, int] = {}
        self._lock = threading.Lock()
        self._bar: Progress | None = None
        self._test_cache: tuple[np.ndarray, np.ndarray] | None = None

    # -- set-up ---------------------------------------------------------------------------------

    @staticmethod
    def _augment(augment):
        from ..data import augment as aug

        if augment is None:
            augment = config.get("augment.enabled")
        if augment is True:
            return aug.Augment.from_config()
        if augment is False:
            return None
        return augment

    def _start(self) -> None:
        if self.client is None:
            from ..cluster import local

            self.client = local()
        self.client.subscribe_topic(PROGRESS_TOPIC, self._on_progress)
        trainers = workers_with_role(self.client, TRAIN)
        if not trainers:
            raise ClusterError(
                "the cluster has no TRAIN workers",
                "start workers with --resources TRAIN=1 or use adam_dask.cluster.assign_roles",
            )
        if not workers_with_role(self.client, PS):
            raise ClusterError(
                "the cluster has no PS workers",
                "start workers with --resources PS=1 or use assign_roles",
            )
        self.replicas = self._replicas or len(trainers)
        if self.replicas > len(trainers):
            logger.warning(
                "%d replicas on %d TRAIN workers: replicas queue for a worker",
                self.replicas,
                len(trainers),
            )
        if self.server is None:
            from ..ps.server import ParameterServer

            self.server = ParameterServer.create(
                self.client,
                layout=self.net.layout,
                init=self.net.flat,
                shard_bytes=self.shard_bytes,
                checkpoint=self.checkpoint,
                storage_options=self.storage_options,
                meta=self._meta(),
            )
        if self.dataservice is None:
            from ..data.serving import DataService

            self.dataservice = DataService.create(
                self.client,
                self.data_url,
                split="train",
                storage_options=self.storage_options,
                augment=self.augment,
                seed=self.seed,
                batch_size=self._stream_batch(),
            )

    @staticmethod
    def _refuse_existing_checkpoint(url: str, storage_options: dict | None) -> None:
        """A new run must not write over a checkpoint that holds another run's weights."""
        from ..errors import DestinationExistsError
        from ..storage import filesystem

        fs, path = filesystem(url, storage_options)
        if fs.exists(path.rstrip("/") + "/manifest.json"):
            raise DestinationExistsError(
                f"a checkpoint already exists at {url}",
                "continue it with --resume (Trainer.resume), replace it with --overwrite "
                "(overwrite=True), or choose another URL",
            )

    def _stream_batch(self) -> int:
        # batches from the stream: a multiple of the update mini-batch, big enough to amortize calls
        return self.batch_size * max(1, 64 // self.batch_size)

    def _meta(self) -> dict:
        return {
            "model": self.net.to_dict(),
            "data": self.data_url,
            "mode": self.mode,
            "lr": self.lr,
            "push_every": self.push_every,
            "run": self.run_id,
        }

    def set_replicas(self, n: int) -> None:
        if n < 1:
            raise ConfigError(f"replicas={n}", "use at least one replica")
        self._replicas = int(n)

    # -- progress ---------------------------------------------------------------------------------

    def _on_progress(self, event) -> None:
        _, msg = event
        if msg.get("run") != self.run_id or msg.get("epoch") != self.epoch:
            return
        with self._lock:
            self._progress_state[msg["replica"]] = msg["images"]
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
        """Train for ``epochs`` more epochs, or until ``target_accuracy`` or ``max_seconds``.

        Returns the :attr:`history`; ``self.seconds_to_target`` holds the wall seconds from the
        start of ``fit`` to the end of the first epoch at or above ``target_accuracy``.
        """
        epochs = int(config.get("train.epochs", epochs))
        self._start()
        t_start = time.perf_counter()
        self.seconds_to_target = None
        last = self.epoch + epochs
        while self.epoch < last:
            record = self._run_epoch()
            record["wall_seconds"] = round(time.perf_counter() - t_start, 3)
            self.history.append(record)
            self._save_history()
            logger.info(
                "epoch %d: loss %.4f, test accuracy %.4f, %.0f images/s",
                record["epoch"],
                record["loss"],
                record["test_accuracy"],
                record["images_per_second"],
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
        return self.history

    def _run_epoch(self) -> dict:
        from distributed import Event, as_completed

        epoch, R = self.epoch, self.replicas
        lr = self.lr * self.lr_decay**epoch
        jobs = [
            ReplicaJob(
                run_id=self.run_id,
                replica=i,
                replicas=R,
                epoch=epoch,
                model=self.net.to_dict(),
                mode=self.mode,
                push_every=self.push_every,
                lr=lr,
                momentum=self.momentum,
                batch_size=self.batch_size,
                threads=self.threads,
                seed=self.seed,
                delay=float(self.slow_replicas.get(i, 0.0)),
                sync_timeout=float(config.get("train.sync-timeout")),
                offload_dense=self.offload_dense,
            )
            for i in range(R)
        ]
        stop = Event(jobs[0].stop_name, client=self.client)
        stop.clear()
        barrier = None
        if self.mode == "sync":
            host = workers_with_role(self.client, PS)[0]
            barrier = self.client.submit(
                SyncBarrier,
                R,
                actor=True,
                workers=[host],
                allow_other_workers=False,
                key=f"adam-{self.run_id}-barrier-{epoch}",
            ).result()
        self._progress_state = {}
        total_images = len(self.train_split)
        self._bar = Progress(total_images, desc=f"epoch {epoch + 1}", enabled=self.progress)
        stats_before = self._ps_stats()
        t0 = time.perf_counter()
        # One graph for all replicas: the scheduler places them in one pass, each placement
        # raising its worker's occupancy, so they spread over the TRAIN workers. (Submitted one
        # by one, a replica that already seceded leaves its worker looking idle, and the next
        # could queue there behind the held TRAIN resource; pinning instead breaks the rerun of
        # a replica whose worker died.)
        futures = self.client.map(
            run_replica,
            jobs,
            server=self.server,
            data=self.dataservice,
            barrier=barrier,
            resources={TRAIN: 1},
            pure=False,
            key=[f"adam-{self.run_id}-e{epoch}-r{job.replica}" for job in jobs],
        )
        needed = max(1, math.ceil(self.epoch_quorum * R - 1e-9))
        results = []
        quorum_seconds = None
        try:
            for fut in as_completed(futures):
                results.append(fut.result())
                logger.debug("replica result %s", results[-1])
                if len(results) == needed and needed < R:
                    quorum_seconds = time.perf_counter() - t0
                    logger.info(
                        "epoch %d: %d of %d replicas done; stopping the rest", epoch, needed, R
                    )
                    stop.set()
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            raise
        finally:
            self._bar.close()
            self._bar = None
            stop.clear()
        seconds = time.perf_counter() - t0
        images = sum(r["images"] for r in results)
        loss = (
            sum(r["loss"] * r["images"] for r in results if r["images"]) / images
            if images
            else float("nan")
        )
        flush_t = time.perf_counter()
        self.server.flush(epoch=epoch)
        flush_seconds = time.perf_counter() - flush_t
        acc = self.evaluate()
        stats_after = self._ps_stats()
        # shard updates applied by the primaries during the epoch
        pushes = stats_after.get("pushes_applied", 0) - stats_before.get("pushes_applied", 0)
        replica_seconds = sum(r["seconds"] for r in results)
        return {
            "epoch": epoch,
            "loss": loss,
            "test_accuracy": acc,
            "images": images,
            "images_per_second": images / seconds if seconds else 0.0,
            "seconds": seconds,
            "quorum_seconds": quorum_seconds,
            "flush_seconds": flush_seconds,
            "stall_fraction": max((r["stall_fraction"] for r in results), default=0.0),
            "ps_updates_per_second": pushes / seconds if seconds else 0.0,
            "ps_fraction": (
                sum(r["ps_seconds"] for r in results) / replica_seconds if replica_seconds else 0.0
            ),
            "replication_lag": stats_after.get("max_replication_lag"),
            "writeback_lag": stats_after.get("writeback_lag_seconds"),
            "writeback_lag_versions": stats_after.get("writeback_lag_versions"),
            "replicas_finished": sum(not r["stopped"] for r in results),
            "replicas": R,
            "replica_workers": sorted(r["worker"] for r in results),
            "lr": lr,
            "mode": self.mode,
        }

    def _ps_stats(self) -> dict:
        try:
            return self.server.stats()
        except Exception:  # statistics never fail a run
            logger.debug("PS statistics unavailable", exc_info=True)
            return {}

    def _save_history(self) -> None:
        if not self.checkpoint:
            return
        from ..storage import normalize_url, options_for

        url = normalize_url(self.checkpoint) + "/history.jsonl"
        self.history.save(url, options_for(url, self.storage_options))

    # -- evaluation ------------------------------------------------------------------------------

    def _test_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._test_cache is None:
            if self.test_split is not None:
                self._test_cache = self.test_split.read()
            else:
                self._test_cache = self.train_split.read(0, min(10000, len(self.train_split)))
        return self._test_cache

    def evaluate(self, data: str | None = None, split: str = "test") -> float:
        """Top-1 accuracy of the parameter server's current weights on ``data`` (default: the
        training store's test split)."""
        if self.server is not None:
            self.net.flat = self.server.pull()
        if data is None:
            x, y = self._test_arrays()
        else:
            from ..data.datasets import open_split

            x, y = open_split(data, split, self.storage_options).read()
        return float(self.net.evaluate(x, y))

    # -- lifecycle -------------------------------------------------------------------------------

    def save(self) -> str:
        """Flush every push to the checkpoint (manifest written last); returns its URL."""
        if not self.checkpoint or self.server is None:
            raise ConfigError("this Trainer has no checkpoint URL", "pass checkpoint= to Trainer")
        self.server.flush(epoch=self.epoch - 1)
        self._save_history()
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
        """A Trainer that continues from the checkpoint at ``checkpoint`` (weights, epoch and
        history)."""
        from ..model.network import Network
        from ..ps.server import ParameterServer
        from ..storage import normalize_url, options_for

        own = client is None
        if own:
            from ..cluster import local

            client = local()
        try:
            server = ParameterServer.restore(client, checkpoint, storage_options=storage_options)
            meta = server.meta or {}
            net = Network.from_dict(meta["model"])
            net.flat = server.pull()
            records = []
            url = normalize_url(checkpoint) + "/history.jsonl"
            try:
                records = History.load(url, options_for(url, storage_options)).records
            except FileNotFoundError:
                logger.warning("no history at %s; the resumed run starts a new one", url)
            epoch = (
                int(server.epoch + 1)
                if getattr(server, "epoch", None) is not None
                else len(records)
            )
            kwargs.setdefault("mode", meta.get("mode"))
            trainer = cls(
                data or meta["data"],
                model=net,
                client=client,
                checkpoint=checkpoint,
                storage_options=storage_options,
                _server=server,
                _history=History(records=records),
                _first_epoch=epoch,
                **kwargs,
            )
        except BaseException:
            if own:
                client.close()
            raise
        trainer._own_client = own
        return trainer

    def close(self) -> None:
        """Release the data servers and the parameter server; close an embedded cluster."""
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
