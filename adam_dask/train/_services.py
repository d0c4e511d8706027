"""The services a Trainer's run starts on its cluster before the first epoch, as functions of
explicit arguments: the client (the embedded cluster when none is given), the parameter server
(new, or restored from a checkpoint) and the data servers. The Trainer (trainer.py) holds what
they return and closes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cluster import PS, workers_with_role
from ..errors import ClusterError
from ._settings import RunSettings

if TYPE_CHECKING:
    from ._handle import TrainerServer

__all__ = ["connect", "require_ps", "restore_server", "start_data", "start_server"]


def connect(client: Any) -> Any:
    """``client``, or a client of the embedded cluster (:func:`adam_dask.cluster.local`) when
    it is None, its scheduler given the replica placement plugin (:mod:`.placement`)."""
    from .placement import PLUGIN_NAME, ReplicaPlacement

    if client is None:
        from ..cluster import local

        client = local()
    client.register_plugin(ReplicaPlacement(), name=PLUGIN_NAME)
    return client


def require_ps(client: Any) -> list[str]:
    """The PS workers of ``client``'s cluster; :class:`ClusterError` when there are none."""
    workers = workers_with_role(client, PS)
    if not workers:
        raise ClusterError(
            "the cluster has no PS workers",
            "start workers with --resources PS=1 or use assign_roles",
        )
    return workers


def start_server(
    client: Any,
    net: Any,
    *,
    shard_bytes: int | None,
    checkpoint: str | None,
    storage_options: dict | None,
    meta: dict,
    optimizer: str | None = None,
) -> TrainerServer:
    """A new parameter server holding ``net``'s weights on the PS workers (``checkpoint``: where
    it writes back, with the run's ``meta``; ``optimizer``: the server optimizer's name)."""
    from ..ps.client.server import ParameterServer

    return ParameterServer.create(
        client,
        layout=net.layout,
        init=net.flat,
        shard_bytes=shard_bytes,
        checkpoint=checkpoint,
        storage_options=storage_options,
        meta=meta,
        optimizer=optimizer,
    )


def restore_server(
    client: Any, checkpoint: str, storage_options: dict | None, given: dict | None = None
) -> TrainerServer:
    """The parameter server of the run checkpointed at ``checkpoint``, restored from it, with
    the server optimizer it ran with unless ``given`` (the resume's keywords) names another."""
    from ..ps.client.server import ParameterServer

    optimizer = (given or {}).get("server_optimizer")
    return ParameterServer.restore(
        client, checkpoint, storage_options=storage_options, optimizer=optimizer
    )


def start_data(
    client: Any, url: str, *, storage_options: dict | None, augment: Any, settings: RunSettings
) -> Any:
    """The data servers of the store at ``url``'s ``train`` split, serving batches sized for
    the replicas' threads (``settings.threads``, or the most a TRAIN worker has)."""
    from ..data.serving import DataService
    from ._epoch_run import train_threads

    threads = settings.threads or train_threads(client)
    return DataService.create(
        client,
        url,
        split="train",
        storage_options=storage_options,
        augment=augment,
        seed=settings.seed,
        batch_size=settings.stream_batch(threads),
    )
