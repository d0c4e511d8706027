"""dask-gateway cluster options for adam_dask: role counts, worker cores and memory.

This file runs inside dask-gateway-server's configuration (the Helm chart's
``gateway.extraConfig``; ``values.yaml`` embeds it verbatim and a test keeps the two equal), so
it imports only the standard library and dask_gateway_server, never adam_dask. A user picks

* ``ps_nodes``, ``data_nodes``, ``trainers``: how many parameter-server, data-serving and
  training workers the cluster gets;
* ``worker_cores`` (threads too) and ``worker_memory`` (GiB) of every worker.

The handler turns them into the cluster's configuration: worker cores, threads and memory, at
most ``ps_nodes + data_nodes + trainers`` workers, and the counts in the scheduler's and workers'
environment (``DASK_ADAM__CLUSTER__PS_NODES`` ...), where ``dask.config.get("adam.cluster")``
finds them. Gateway workers all start alike; roles are given once they are up
(``adam_dask.cluster.assign_roles`` with those counts, as ``pipelines/train.py --gateway`` and
``adam_dask.cluster.client_for`` do).

:func:`scheduler_command` adds the scheduler preloads the clusters need: the parameter-server
controller (``adam_dask.ps.placement``) and the Adam page (``adam_dask.dashboard``).

(No ``from __future__ import annotations``: the chart pastes this text into the middle of its
generated configuration file, where a future import is a syntax error.)
"""

from collections.abc import Mapping, Sequence
from typing import Any

from dask_gateway_server.options import Float, Integer, Options

__all__ = ["SCHEDULER_PRELOADS", "adam_cluster_options", "options_handler", "scheduler_command"]

SCHEDULER_PRELOADS = ("adam_dask.ps.placement", "adam_dask.dashboard")
GIB = 2**30


def scheduler_command(base: Sequence[str]) -> list[str]:
    """``base`` (``["dask", "scheduler"]``) with adam_dask's scheduler preloads."""
    cmd = list(base)
    for module in SCHEDULER_PRELOADS:
        cmd += ["--preload", module]
    return cmd


def options_handler(options: Any, environment: Mapping[str, str] | None = None) -> dict:
    """The cluster configuration for the chosen ``options`` (a gateway options handler).

    ``environment`` holds variables every cluster gets besides the role counts (the handler's
    ``environment`` replaces the backend's, so they are passed here).
    """
    workers = options.ps_nodes + options.data_nodes + options.trainers
    env = dict(environment or {})
    env.update(
        {
            "DASK_ADAM__CLUSTER__PS_NODES": str(options.ps_nodes),
            "DASK_ADAM__CLUSTER__DATA_NODES": str(options.data_nodes),
            "DASK_ADAM__CLUSTER__TRAINERS": str(options.trainers),
            "DASK_ADAM__CLUSTER__TRAINER_THREADS": str(options.worker_cores),
        }
    )
    return {
        "worker_cores": options.worker_cores,
        "worker_threads": options.worker_cores,
        "worker_memory": int(options.worker_memory * GIB),
        "cluster_max_workers": workers,
        "environment": env,
    }


def adam_cluster_options(
    *,
    ps_nodes: int,
    data_nodes: int,
    trainers: int,
    worker_cores: int,
    worker_memory: float,
    max_workers: int = 64,
    max_cores: int = 16,
    max_memory: float = 64.0,
    environment: Mapping[str, str] | None = None,
) -> Options:
    """The options users see (defaults as given, bounded) with :func:`options_handler`.

    The defaults are passed in (``values.yaml`` gives the ``adam.cluster`` defaults of
    adam_dask's ``adam.yaml``), so this file holds none of its own.
    """
    env = dict(environment or {})

    def handler(options: Any) -> dict:
        return options_handler(options, env)

    return Options(
        Integer("ps_nodes", ps_nodes, min=1, max=max_workers, label="Parameter-server workers"),
        Integer("data_nodes", data_nodes, min=0, max=max_workers, label="Data-serving workers"),
        Integer("trainers", trainers, min=1, max=max_workers, label="Training workers"),
        Integer("worker_cores", worker_cores, min=1, max=max_cores, label="Cores per worker"),
        Float(
            "worker_memory", worker_memory, min=1, max=max_memory, label="Memory per worker (GiB)"
        ),
        handler=handler,
    )
