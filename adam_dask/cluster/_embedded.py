"""The embedded cluster's own client and cluster classes: the client that owns its cluster
(closing one closes the other, never blocking an event loop) and a SpecCluster that keeps its
nannies. :func:`adam_dask.cluster.local` makes them."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from distributed import Client, SpecCluster, Status
from distributed.deploy import Cluster

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedClient", "EmbeddedCluster"]


class EmbeddedClient(Client):
    """A :class:`distributed.Client` that owns its cluster: closing it closes the cluster (the
    client made on the cluster object does; a copy of it does not)."""

    def __init__(self, address: Any = None, *args: Any, **kwargs: Any):
        super().__init__(address, *args, **kwargs)
        if isinstance(address, Cluster):  # by identity: kept through this client's finalising
            setattr(address, "_adam_owner", id(self))  # noqa: B010 (not an attribute of Cluster)

    def close(self, *args, **kwargs):
        cluster = self.cluster
        try:
            return super().close(*args, **kwargs)
        finally:
            if getattr(cluster, "_adam_owner", None) != id(self):
                cluster = None
            # Once only: a closed SpecCluster's close() still stops its loop runner, which takes
            # distributed's class-wide LoopRunner lock. A closed client sits in a reference cycle
            # until a collection finalises it (its __del__ calls close() again), and a collection
            # can run inside a new cluster's start, which holds that lock: the close waited there
            # for good.
            status = getattr(cluster, "status", Status.closed)
            if cluster is not None and status not in (Status.closed, Status.closing):
                _close_cluster(cluster)


class EmbeddedCluster(SpecCluster):
    """The embedded cluster: a :class:`distributed.SpecCluster` of nannies that keeps each
    nanny for as long as the cluster runs. A nanny restarts the worker it lost (a PS worker
    SIGKILLed, a node retired); SpecCluster also closes the nanny of a lost worker when no
    worker of its name is registered ``distributed.deploy.lost-worker-timeout`` (15 s) after the
    loss, and a worker lost again within that time, its restart not yet registered then, lost
    its nanny for good (the PS short of a host for its third copies)."""

    def _update_worker_status(self, op: str, msg: Any) -> None:
        Cluster._update_worker_status(self, op, msg)  # the scheduler's view, no nanny closed


def _close_cluster(cluster: Any) -> None:
    """Close ``cluster``, never blocking an event loop: a client left unclosed is finalised by a
    garbage collection that may run on any thread, an event loop's too (another cluster's
    scheduler, mid-write), where a blocking close would stop that loop for good. There, the
    close runs in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop runs in this thread: close here
        try:
            cluster.close()
        except Exception:  # pragma: no cover - best effort at shutdown
            logger.exception("closing the embedded cluster failed")
        return
    threading.Thread(target=_close_cluster, args=(cluster,), name="adam-close", daemon=True).start()
