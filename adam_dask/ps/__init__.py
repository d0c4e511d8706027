"""The global parameter server (paper section 3.3): sharded, three copies of every shard on
distinct hosts, batched updates, asynchronous write-back to a checkpoint, fail-over by a
controller in the scheduler.

Users call :class:`ParameterServer` (create, restore, attach, push, push_outer, pull, flush,
stats, close); :class:`ShardPlacement` is the controller, a scheduler plugin
(``ParameterServer.create`` registers it; preload it with ``dask scheduler --preload
adam_dask.ps.placement``). The modules, for a reader:

* ``state.py``: one shard's values, version and push ids (pure); ``_node_state.py``: a node's
  protocol (pure); ``node.py``: the PSNode actor that carries it out.
* ``_policy.py``: where copies go (pure policy), re-exported with the preload hook by
  ``placement.py``; ``_controller.py``: the controller's
  decisions (pure); ``_plugin.py``: the scheduler plugin that carries them out.
* the client: ``server.py`` (the handle) builds one ``Request`` (``_request.py``, with the
  pure ``Delivery`` that routes and retries it) for every push, pull and question, which its
  ``Courier`` (``_courier.py``) carries over the data plane (``_plane.py``; the node's side
  ``_plane_server.py``) or, for control, Dask (``_control.py``), holding a ``Routing``
  (``_routing.py``) and a ``ReplayLog`` (``_replay.py``: pushes a pusher keeps until every copy
  holds them). ``checkpoint.py``: blocks and the manifest.
* ``simulation.py``: a deterministic simulation of the protocol with faults.
"""

from __future__ import annotations

from ._plugin import ShardPlacement
from .server import ParameterServer

ReplicaPlacement = ShardPlacement  # the older name of the controller plugin

__all__ = ["ParameterServer", "ReplicaPlacement", "ShardPlacement"]
