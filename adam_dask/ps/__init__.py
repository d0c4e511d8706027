"""The global parameter server (paper section 3.3): sharded, three copies of every shard on
distinct hosts, batched updates, asynchronous write-back to a checkpoint, fail-over by a
controller in the scheduler.

Users call :class:`ParameterServer` (create, restore, attach, push, push_outer, pull, flush,
stats, close); :class:`ShardPlacement` is the controller, a scheduler plugin
(``ParameterServer.create`` registers it; preload it with ``dask scheduler --preload
adam_dask.ps.placement``). The sub-packages, by what they do:

* :mod:`.protocol`: pure (no Dask, no sockets, no clock): a shard (and the numba kernels of
  its updates, ``shard_kernels.py``), a node's protocol, the controller's decisions, where
  copies go, the manifest, the client's request and routing, the replay log, the messages
  between them;
* :mod:`.runtime`: carrying them out on Dask: the PSNode actor, the scheduler plugin;
* :mod:`.client`: the handle and the courier that carries its requests;
* :mod:`.plane`: the data plane (channels, the node's listeners, forwards, framing);
* :mod:`.checkpoint`: reading and writing the blocks and the manifest.

``placement.py`` is the controller's scheduler preload (it wires the protocol's policy to the
runtime's plugin, so nothing in the sub-packages imports this package's own modules back). The
deterministic simulation of the protocol and the client with faults is in
:mod:`adam_dask.testing.simulation`.
"""

from __future__ import annotations

from .client.server import ParameterServer
from .runtime.plugin import ShardPlacement

__all__ = ["ParameterServer", "ShardPlacement"]
