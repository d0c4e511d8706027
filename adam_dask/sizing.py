"""The embedded cluster sized from the machine it runs on (pure: cores and memory in, counts out).

``adam.cluster.trainers``, ``trainer-threads``, ``data-nodes`` and ``memory-limit`` are
``auto`` by default and resolved here; a number in the configuration or a keyword argument wins. The reasons, measured on
this project's machines, are kept beside the keys in ``adam.yaml``:

* Under 4 cores, one replica with a Hogwild thread per core: on 2 cores one replica of two
  threads reached 99% on MNIST in 2 epochs (23-25 s) where two replicas of one thread needed 3-4
  (32-46 s) at about the same images/s: threads of one replica share their updates at once,
  replicas only every k images through the parameter server.
* From 4 cores, a replica per 8 cores and at least 2 (asynchronous replicas from 4 cores on),
  the cores shared out as Hogwild threads: 4 cores 2 x 2, 8 cores 2 x 4, 16 cores 2 x 8, 32
  cores 4 x 8 (where the epoch's 75% quorum starts to let a straggler go). As the paper ran
  one replica per machine with many threads: on 16 cores (benchmarks/results/scaling.jsonl,
  8a3c5c2) 2 x 8 reached 99% in 3 epochs at 0.86 of the engine's images/s, 1 x 16 in 4, while
  4 x 4 ended 10 epochs at 98.90% and 8 x 2 (the former sizing) diverged: replicas add
  staleness that threads of one replica do not.
* Memory: what the machine has, split evenly over the worker processes (as
  :class:`distributed.LocalCluster` does with ``memory_limit="auto"``).
* DATA workers from the replicas' demand: one per ``DATA_THREADS_PER_NODE`` Hogwild threads of
  all replicas together (at least one), from what one DATA worker served to emulated replicas
  with their stall at most 0.1 (benchmarks/data_capacity.py), in units of one engine thread's
  images/s (see ``adam.cluster.data-nodes`` in ``adam.yaml``).

>>> size_trainers(cores=2)
(1, 2)
>>> size_trainers(cores=16)
(2, 8)
>>> size_data_nodes(trainers=1, threads=2)  # 2 cores
1
>>> size_data_nodes(trainers=2, threads=8)  # 16 cores
2
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = [
    "machine_cores",
    "machine_memory",
    "resolve_threads",
    "size_data_nodes",
    "size_memory_limit",
    "size_trainers",
]

AUTO = "auto"
FEW_CORES = 4  # under this, one replica with a thread per core
CORES_PER_REPLICA = 8  # from FEW_CORES, a replica per this many cores (at least 2)
# Replica threads one DATA worker serves with the replicas' stall at most 0.1: the images/s it
# served so (data_capacity.jsonl, images_per_s_at_stall: 93.5k) over one engine thread's
# (engine.jsonl, images_per_s_1thread: 6443), rounded down; adam.yaml's data-nodes names the lines
DATA_THREADS_PER_NODE = 14


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def machine_memory() -> int:
    """Bytes of memory available to this process (cgroup and rlimit aware, as Dask sees it)."""
    from distributed.system import MEMORY_LIMIT

    return int(MEMORY_LIMIT)


def size_trainers(cores: int) -> tuple[int, int]:
    """``(trainers, threads per trainer)`` for a machine with ``cores`` cores."""
    if cores < 1:
        raise ValueError(f"cores={cores}: a machine has at least one core")
    if cores < FEW_CORES:
        return 1, cores
    replicas = max(2, cores // CORES_PER_REPLICA)
    return replicas, cores // replicas


def size_data_nodes(trainers: int, threads: int, per_node: int = DATA_THREADS_PER_NODE) -> int:
    """DATA workers for ``trainers`` replicas of ``threads`` Hogwild threads each: one per
    ``per_node`` training threads (their images/s is the demand), rounded up, at least one."""
    if trainers < 0 or threads < 1 or per_node < 1:
        raise ValueError(
            f"trainers={trainers}, threads={threads}, per_node={per_node}: "
            "no negative replicas, at least one thread each and per DATA worker"
        )
    return max(1, math.ceil(trainers * threads / per_node))


def size_memory_limit(memory: int, workers: int) -> int:
    """Bytes per worker process: ``memory`` split evenly over ``workers``."""
    if workers < 1:
        raise ValueError(f"workers={workers}: the cluster has at least one worker")
    return max(1, memory // workers)


def resolve_threads(value: Any) -> int:
    """Hogwild threads per replica from a setting that may be ``"auto"`` (sized from the cores
    of the machine that asks: the embedded cluster's, or the client's for a remote one)."""
    if str(value).lower() == AUTO:
        return size_trainers(machine_cores())[1]
    return int(value)
