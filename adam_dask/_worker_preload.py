"""A Dask worker preload of the embedded cluster: the worker process ignores SIGINT, and its
log records are redacted (:mod:`adam_dask._secrets`) from its start.

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
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from ._secrets import install

__all__ = ["RedactLogs", "dask_setup", "stamp_library_logs"]


def dask_setup(worker: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    install()
    stamp_library_logs()


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
