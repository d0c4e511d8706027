"""The Trainer's side of a checkpoint: where a run writes it (its run folder by default), refuse
to overwrite one, the epochs' commits (off the training path, through storage outages, and the
waits for them), its
history file, and the state a resumed run starts from (weights, epoch, history, plan and
settings)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import config
from ..errors import ConfigError, DestinationExistsError, StorageError
from .metrics import History

if TYPE_CHECKING:
    from ._handle import TrainerServer

__all__ = [
    "AVERAGE",
    "HISTORY",
    "EpochCommits",
    "Resumed",
    "far_hosts",
    "history_url",
    "load_average",
    "refuse_existing",
    "resumed_state",
    "run_folder",
    "run_meta",
    "save_average",
    "start_commits",
]

logger = logging.getLogger(__name__)

HISTORY = "history.jsonl"
AVERAGE = "average"  # the tail average's float64 sum, a Zarr array beside the shards

# the stored settings a resumed run keeps unless the caller gives new ones
_RESUMABLE = (
    "mode",
    "push_every",
    "lr",
    "lr_schedule",
    "lr_floor",
    "lr_warmup",
    "lr_replicas",
    "lr_streams",
    "momentum",
    "batch_size",
    "threads",
    "seed",
    "epoch_quorum",
    "offload_dense",
    "average_from",
    "server_optimizer",
)


def run_folder(checkpoint: str | bool | None, run_id: str) -> str | None:
    """The checkpoint URL of a run: ``checkpoint`` when it is one; for None (not given) a new
    folder ``<adam.train.runs-dir>/<date>-<time>-<run id>`` (absolute when local: every process
    of the cluster on this machine writes the same place), None when ``runs-dir`` is null; for
    False, None: no checkpoint."""
    from ..storage import join_url, normalize_url

    if checkpoint is False:
        return None
    if checkpoint is None:
        root = config.get("train.runs-dir")
        if root is None or str(root).strip() == "":
            return None
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id[:6]}"
        return join_url(normalize_url(str(root)), name)
    if checkpoint is True or not isinstance(checkpoint, str) or not checkpoint.strip():
        raise ConfigError(
            f"checkpoint={checkpoint!r}",
            "give a URL, None for the run folder (adam.train.runs-dir) or False for none",
        )
    return checkpoint


def far_hosts(url: str, workers: list[str]) -> list[str]:
    """The hosts among ``workers`` (addresses) that are not this machine when ``url`` is a
    local path: they would write their parts of the checkpoint to their own disks."""
    import socket

    from distributed.comm import get_address_host

    if "://" in url:
        return []
    here = {"localhost", "::1", socket.gethostname()}
    try:
        here.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:  # pragma: no cover - no name service
        pass
    hosts = {get_address_host(a) for a in workers}
    return sorted(h for h in hosts if h not in here and not h.startswith("127."))


def refuse_existing(url: str, storage_options: dict | None) -> None:
    """A new run must not write over a checkpoint that holds another run's weights."""
    from ..ps.checkpoint import MANIFEST
    from ..storage import filesystem

    fs, path = filesystem(url, storage_options)
    if fs.exists(path.rstrip("/") + "/" + MANIFEST):
        raise DestinationExistsError(
            f"a checkpoint already exists at {url}",
            "continue it with --resume (Trainer.resume), replace it with --overwrite "
            "(overwrite=True), or choose another URL",
        )


def start_commits(
    server: TrainerServer, url: str, storage_options: dict | None, ps_workers: list[str]
) -> EpochCommits:
    """The commits of a run's epochs to its checkpoint ``url``; a warning when ``url`` is a
    local path while ``ps_workers`` run on other hosts (each would write its own disk)."""
    from ..storage import redact_url

    commits = EpochCommits(server, url, storage_options)
    logger.info("checkpoint: %s", redact_url(url))
    far = far_hosts(url, ps_workers)
    if far:
        logger.warning(
            "the checkpoint %s is a local path but PS workers run on %s: each writes "
            "to its own disk; give a URL they all reach (checkpoint=, "
            "adam.train.runs-dir: s3://...)",
            url,
            ", ".join(far),
        )
    return commits


def history_url(checkpoint: str) -> str:
    from ..storage import normalize_url

    return normalize_url(checkpoint) + "/" + HISTORY


def save_average(checkpoint: str, average: Any, storage_options: dict | None) -> None:
    """Write a :class:`~._average.TailAverage` into the checkpoint (whole, once per epoch:
    the sum is the size of the model), so a resumed run goes on averaging."""
    import zarr

    from ..storage import join_url, normalize_url, zarr_store

    total, attrs = average.state()
    if total is None:
        return
    url = join_url(normalize_url(checkpoint), AVERAGE)
    arr = zarr.create_array(
        store=zarr_store(url, storage_options, read_only=False),
        shape=total.shape,
        dtype="float64",
        chunks=total.shape,
        attributes=attrs,
        overwrite=True,
    )
    arr[...] = total


def load_average(checkpoint: str, storage_options: dict | None, next_epoch: int) -> Any:
    """The tail average stored in the checkpoint, without the epochs a resumed run trains
    again (from ``next_epoch`` on); None when the checkpoint holds none."""
    import zarr

    from ..storage import join_url, normalize_url, zarr_store
    from ._average import TailAverage

    url = join_url(normalize_url(checkpoint), AVERAGE)
    try:
        arr = zarr.open_array(store=zarr_store(url, storage_options), mode="r")
    except (FileNotFoundError, zarr.errors.NodeNotFoundError, zarr.errors.ArrayNotFoundError):
        return None
    attrs: dict[str, Any] = dict(arr.attrs)
    if any(int(e) >= next_epoch for e in attrs.get("epochs") or ()):
        # the average is written after the shards' flush: an epoch it holds that the shards'
        # manifest does not is trained again, and averaged again, so drop the stored mean
        logger.warning(
            "the weight average at %s holds epochs the checkpoint does not; it starts anew", url
        )
        return TailAverage(start_epoch=int(attrs["start_epoch"]))
    return TailAverage.from_state(np.asarray(arr[...]), attrs)


@dataclass(frozen=True, slots=True)
class Resumed:
    """What a resumed Trainer starts from."""

    net: Any  # Network holding the checkpoint's weights
    data: str
    settings: dict  # keywords for the Trainer: the caller's, else the stored ones
    records: list[dict]
    epoch: int  # the next epoch to train
    epochs: int | None  # the run's planned total
    mode: str | None  # the stored mode


def resumed_state(
    server: TrainerServer,
    checkpoint: str,
    data: str | None,
    storage_options: dict | None,
    given: dict,
) -> Resumed:
    """The state in the checkpoint that ``server`` was restored from; ``given`` are the
    caller's Trainer keywords (None = keep the stored setting)."""
    from ..model.engines import network_from_dict
    from ..storage import options_for

    meta = server.meta or {}
    net = network_from_dict(meta["model"])
    net.flat = server.pull()
    kwargs = dict(given)
    stored = dict(meta.get("settings") or {"mode": meta.get("mode")})
    for name, value in stored.items():
        if name in _RESUMABLE and kwargs.get(name) is None:
            kwargs[name] = value
    url = history_url(checkpoint)
    try:
        records = History.load(url, options_for(url, storage_options)).records
    except FileNotFoundError:
        logger.warning("no history at %s; the resumed run starts a new one", url)
        records = []
    epoch = int(server.epoch) + 1 if server.epoch is not None else len(records)
    return Resumed(
        net=net,
        data=data or meta["data"],
        settings=kwargs,
        records=records,
        epoch=epoch,
        epochs=meta.get("epochs"),
        mode=meta.get("mode"),
    )


@dataclass(frozen=True, slots=True)
class _Commit:
    """What the checkpoint holds once an epoch's end is committed."""

    epoch: int
    meta: dict
    records: list[dict]  # the history up to that epoch
    average: Any  # a copy of the tail average (TailAverage), or None


class EpochCommits:
    """The checkpoint's part of an epoch's end, in a thread of its own, so storage never holds
    training up.

    An epoch ends once every copy of every shard holds its pushes
    (``ParameterServer.flush(copies_only=True)``); here the checkpoint then catches up: a
    flush that waits for the write-back and stores the epoch and the run's meta in the
    manifest (so a manifest names an epoch only when its blocks hold all of it), then the
    history and the weight average beside it. In a storage outage each try ends after
    ``adam.ps.flush-timeout`` and the next begins at once, a newer epoch's commit taking the
    place of one still waiting, while training goes on and the pushes wait in the copies (and,
    within ``adam.ps.replay-bytes``, with their pushers); the outage is reported once, naming
    storage, and so is its end: at the first epoch's end that finds the scheduler failing to
    write the manifest (:meth:`watch`), else when a try fails.
    """

    def __init__(self, server: TrainerServer, url: str, storage_options: dict | None):
        self.server = server
        self.url = url
        self.storage_options = storage_options
        # the newest epoch the checkpoint holds (a restored server's: its manifest's)
        self.committed: int | None = server.epoch
        self.error: BaseException | None = None  # the last failure, while storage fails
        self._written = 0  # commits written so far
        self._job: _Commit | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, epoch: int, meta: dict, records: list[dict], average: Any) -> None:
        """Commit the end of ``epoch`` (replacing an older epoch's commit still waiting)."""
        from ._average import TailAverage

        if average is not None and average.count:
            average = TailAverage.from_state(*average.state())  # a copy: training goes on
        else:
            average = None
        job = _Commit(int(epoch), dict(meta), [dict(r) for r in records], average)
        with self._cond:
            self._job = job
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="adam-checkpoint", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    @property
    def pending(self) -> bool:
        """An epoch's commit is still to be written."""
        with self._cond:
            return self._job is not None

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every submitted commit is written."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._job is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def failure(self, what: str) -> StorageError:
        """The error of a commit not written in time: storage's, named with its URL."""
        held = "nothing yet" if self.committed is None else f"epoch {self.committed}"
        cause = self.error if self.error is not None else StorageError("no answer")
        return StorageError(
            f"{self._describe(cause)}; the checkpoint holds {held}, not {what}",
            "the weights are still on the parameter server: Trainer.save() tries again",
        )

    def _describe(self, exc: BaseException) -> str:
        """One line: storage and its URL when storage is the cause."""
        if isinstance(exc, StorageError):
            return str(self.server.storage_error(exc).message)
        return " ".join(str(exc).split()) or type(exc).__name__

    def caught_up(self, what: str) -> None:
        """Wait for the checkpoint to hold every epoch committed (``adam.ps.flush-timeout``),
        saying once that it waits when storage is out; :meth:`failure` (a
        :class:`StorageError` naming storage) when it does not."""
        deadline = time.monotonic() + float(config.get("ps.flush-timeout"))
        pause = float(config.get("ps.retry-max"))
        said = False
        while not self.wait(max(min(pause, deadline - time.monotonic()), 0.0)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.failure(what)
            self.watch()  # an outage that began in the last epoch is said here
            if self.error is not None and not said:
                said = True
                logger.warning(
                    "waiting up to %.0fs more for storage %s to take the checkpoint of %s",
                    left,
                    self._shown(),
                    what,
                )

    def finish(self, what: str) -> None:
        """Wait for the commits still to write (``adam.ps.flush-timeout``, not while storage is
        out), warn when ``what`` (the last epoch trained) is not in the checkpoint, and stop."""
        if self.pending and self.error is None:
            self.wait(float(config.get("ps.flush-timeout")))
        if self.pending:
            logger.warning("%s", self.failure(what).message)
        self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                job = self._job
                if job is None or (self._closed and self.error is not None):
                    return  # closed: nothing to write, or storage is out (no endless tries)
            try:
                self._write(job)
            except Exception as exc:
                if self._closed and isinstance(exc, RuntimeError):
                    return  # the server was closed under the last try
                self._failed(job, exc)
                continue
            with self._cond:
                if self._job is job:
                    self._job = None
                self.committed = job.epoch
                self._written += 1
                back, self.error = self.error is not None, None
                self._cond.notify_all()
            if back:
                logger.warning(
                    "storage %s answers again: the checkpoint caught up with epoch %d",
                    self._shown(),
                    job.epoch,
                )

    def _write(self, job: _Commit) -> None:
        from ..storage import options_for

        self.server.flush(epoch=job.epoch, meta=job.meta)
        url = history_url(self.url)
        try:
            History(records=job.records).save(url, options_for(url, self.storage_options))
        except Exception as exc:
            raise self.server.storage_error(exc) from exc
        if job.average is not None:
            try:
                save_average(self.url, job.average, self.storage_options)
            except Exception as exc:  # the mean stays in memory: only a resume would miss it
                logger.warning(
                    "could not store the weight average in %s (%s); training goes on, and a "
                    "run resumed from there averages anew",
                    self._shown(),
                    exc,
                )

    def _failed(self, job: _Commit, exc: BaseException) -> None:
        self._outage(exc, job.epoch)
        with self._cond:  # a short pause: a failing store answers at once
            if not self._closed:
                self._cond.wait(float(config.get("ps.retry-max")))

    def watch(self) -> None:
        """Say it at once when the scheduler fails to write the manifest while a commit waits
        for it (asked at an epoch's end), rather than when that commit's flush times out
        (``adam.ps.flush-timeout``, minutes): once per outage, as a failed commit would."""
        with self._cond:
            job, written = self._job, self._written
        if job is None:
            return
        try:
            info = self.server.routing_info()
        except Exception:  # the controller's record is news, never a failure
            logger.debug("no routing info", exc_info=True)
            return
        if not int(info.get("manifest_failing") or 0):
            return
        why = info.get("last_manifest_error") or "no answer"
        exc = StorageError(f"the scheduler could not write the manifest ({why})")
        self._outage(exc, job.epoch, written)

    def _outage(self, exc: BaseException, epoch: int, written: int | None = None) -> None:
        """Storage failed a commit of ``epoch``: logged once per outage (its end once too).
        ``written``: the commits written when the failure was seen (none since, or it is
        stale)."""
        with self._cond:
            if written is not None and written != self._written:
                return
            first = self.error is None
            self.error = exc
        if first:
            held = "nothing yet" if self.committed is None else f"epoch {self.committed}"
            logger.warning(
                "%s; training goes on and the checkpoint (it holds %s) catches up with epoch %d "
                "when storage answers",
                self._describe(exc),
                held,
                epoch,
            )
        else:
            logger.debug("checkpoint commit of epoch %d failed again: %s", epoch, exc)

    def _shown(self) -> str:
        from ..storage import redact_url

        return redact_url(self.url)


def run_meta(trainer: Any) -> dict:
    """What a run's checkpoint manifest says of the run (a Trainer's model, data, settings)."""
    t = trainer
    parts = (
        t.partition_plan.as_dict() if t.partition_plan is not None and t.partitions > 1 else None
    )
    return {
        "model": t.net.to_dict(),
        "data": t.data_url,
        "mode": t.mode,
        "lr": t.lr,
        "push_every": t.push_every,
        "run": t.run_id,
        "settings": t.settings.to_dict(),
        "partitions": t.partitions,
        "partition_plan": parts,
        "epochs": t.epochs,
    }
