"""The global parameter server (paper section 3.3): sharded, replicated 3x on distinct hosts,
batched updates, asynchronous write-back to a checkpoint, fail-over driven by a scheduler plugin.

* :class:`ParameterServer` (server.py): the client handle: create, push, push_outer, pull,
  flush, restore, attach, stats, close.
* :class:`PSNode` (node.py): the actor on each PS worker holding primaries and backups.
* :class:`ReplicaPlacement` (placement.py): the scheduler plugin, the PS controller and the
  single source of truth for routing (``--preload adam_dask.ps.placement``).
* :class:`ShardState` (state.py): the pure shard logic.
* checkpoint.py: the checkpoint Zarr and its manifest.
"""

from __future__ import annotations

from .node import PSNode
from .placement import ReplicaPlacement, plan_placement
from .server import ParameterServer
from .state import ShardState

__all__ = ["PSNode", "ParameterServer", "ReplicaPlacement", "ShardState", "plan_placement"]
