"""A Dask worker preload of the embedded cluster: the worker process ignores SIGINT, its log
records are redacted (:mod:`adam_dask._secrets`) from its start, and Dask's task profiler is
off where it can deadlock the worker.

The embedded cluster's workers are children of the process that started it (a notebook's
kernel, ``adam-dask train`` in a terminal), in its process group. A Jupyter kernel's stop button
and a terminal's Ctrl-C send SIGINT to the whole group: the user means the training call, which
stops its replicas and returns; a worker killed by it would lose its shards and print a
traceback. The workers end when their cluster closes them.

Redacting from the start covers the AWS variables the worker inherited before any task runs;
the credentials of storage options join when the worker first opens storage
(:func:`adam_dask.storage.options_for`). The workers of other clusters (``--scheduler``, a
gateway) have no preload: :class:`RedactLogs`, a worker plugin, does the same there (a parameter
server registers it when made). Both also give the library's records the time and logger
Dask's own records show (:func:`stamp_library_logs`).

Dask's task profiler (the dashboard's Profile page) samples the stack of every thread running
a task each ``distributed.worker.profile.interval`` (10 ms) with ``sys._current_frames()``. On
CPython 3.11 that call can deadlock the whole process (CPython gh-106883): it holds the
interpreter's thread-list lock while it makes frame objects, a garbage collection can run
there, and an object it frees may take that lock again (a ``threading.local``) or run Python
code that lets a thread waiting for the lock take the GIL. Dask turns its event-loop profiler
off on 3.11 for this, not the task profiler, which samples for as long as a replica's task
runs: a TRAIN worker froze so for 556 s (the collector freeing a ``Network``'s
``threading.local``; networks hold none since) until Dask restarted it. With
``adam.cluster.task-profiler`` (``auto``: off on 3.11 only) the preload keeps the profiler from
starting and :class:`TaskProfiler`, a worker plugin a parameter server registers, stops it on
the workers of other clusters (:func:`settle_task_profiler`).
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from . import config, sizing
from ._secrets import install
from .errors import ConfigError

__all__ = [
    "RedactLogs",
    "TaskProfiler",
    "dask_setup",
    "settle_task_profiler",
    "stamp_library_logs",
    "task_profiler_allowed",
]

logger = logging.getLogger(__name__)

#: the worker's periodic callbacks of Dask's task profiler (``Worker.__init__``)
PROFILER_CALLBACKS = ("profile", "profile-cycle")


def dask_setup(worker: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    install()
    stamp_library_logs()
    settle_task_profiler(worker, config.get("cluster.task-profiler"))


def task_profiler_allowed(setting: Any, version: tuple[int, ...] | None = None) -> bool:
    """Whether a worker on Python ``version`` (this one's if omitted) keeps Dask's task profiler
    under ``adam.cluster.task-profiler`` ``setting``: ``auto`` keeps it except on CPython 3.11
    (see the module doc), ``true``/``false`` force it.

    >>> task_profiler_allowed("auto", (3, 11, 7)), task_profiler_allowed("auto", (3, 12, 1))
    (False, True)
    >>> task_profiler_allowed(True, (3, 11, 7))
    True
    """
    if isinstance(setting, bool):
        return setting
    word = str(setting).lower()  # an environment variable's value is a string
    if word in ("true", "false"):
        return word == "true"
    if word != sizing.AUTO:
        raise ConfigError(
            f"adam.cluster.task-profiler is {setting!r}",
            "set it to auto, true or false",
        )
    v = tuple(sys.version_info) if version is None else tuple(version)
    return not (sys.implementation.name == "cpython" and v[:2] == (3, 11))


def settle_task_profiler(worker: Any, setting: Any) -> None:
    """Stop Dask's task profiler on ``worker`` unless ``setting`` allows it here
    (:func:`task_profiler_allowed`). Its callbacks leave the worker's periodic callbacks, so a
    worker still starting never starts them."""
    if task_profiler_allowed(setting):
        return
    stopped = False
    for name in PROFILER_CALLBACKS:
        pc = worker.periodic_callbacks.pop(name, None)
        if pc is not None:
            pc.stop()
            stopped = True
    if stopped:
        logger.info(
            "Dask's task profiler is off on this worker: on CPython %d.%d its stack sampling "
            "can deadlock the process (CPython gh-106883); adam.cluster.task-profiler: true "
            "turns it on",
            *sys.version_info[:2],
        )


def stamp_library_logs() -> None:
    """Show this worker's ``adam_dask`` records as its ``distributed`` ones are shown (Dask's
    ``distributed.admin.log-format``: time, logger, level) where nothing else would show
    them but Python's last resort, which prints the bare message: a stream's recovery and a
    node's rebuild are then placed in time beside the faults that caused them. A handler the
    user configured (on ``adam_dask`` or the root logger) is left alone; levels are not
    changed."""
    lib, shown = logging.getLogger("adam_dask"), logging.getLogger("distributed")
    if lib.handlers or logging.getLogger().handlers or not shown.handlers:
        return
    for handler in shown.handlers:
        lib.addHandler(handler)


class RedactLogs(WorkerPlugin):
    """Redact every log record of each worker (:func:`adam_dask._secrets.install`). It sends
    no secret: each worker knows those of its own environment and of the storage it opens."""

    name = "adam-redact-logs"
    idempotent = True

    def setup(self, worker: Any) -> None:
        install()
        stamp_library_logs()


class TaskProfiler(WorkerPlugin):
    """Dask's task profiler off where ``setting`` (``adam.cluster.task-profiler`` where the
    plugin is made) does not allow it, judged on each worker by its own Python
    (:func:`settle_task_profiler`)."""

    name = "adam-task-profiler"
    idempotent = True

    def __init__(self, setting: Any = None):
        self.setting = config.get("cluster.task-profiler", setting)
        task_profiler_allowed(self.setting)  # a bad setting fails here, not on each worker

    def setup(self, worker: Any) -> None:
        settle_task_profiler(worker, self.setting)
