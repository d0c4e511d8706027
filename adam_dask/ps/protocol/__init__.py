"""The parameter server's protocol, pure: no Dask, no sockets, no clock (time comes as events).

* :mod:`.shard`: one shard's values, version, push ids and marks (``ShardState``, ``Mark``),
  its copies (``ShardCopy``); :mod:`.optimizer`: what a shard does with a push (the sum,
  Nesterov momentum, staleness); :mod:`.outer`: the dense offload's update cut to a shard;
* :mod:`.node_state` with :mod:`.node_commands`: what a node does with the events it gets
  (pushes, forwards, fences, promotions) and the actions it asks its runtime for;
* :mod:`.controller` with :mod:`.repair`: the controller's decisions (placement, fail-over,
  repair, restore from the checkpoint); :mod:`.policy`: where copies go;
* :mod:`.manifest`: which checkpoint blocks hold what;
* :mod:`.request`: the one request type of the client and its ``Delivery`` (routing, retries);
  :mod:`.routing`: the client's copy of the controller's table; :mod:`.replay`: the pushes a
  pusher keeps until every copy holds them; :mod:`.courier_plan`: what a pusher does with
  them (make room, replay, deliver, settle), step by step;
* :mod:`.messages`: the events and actions that cross between them; :mod:`.replies`: what
  the machines answer (typed; the same dicts as ever on a wire); :mod:`.node_requests`: what
  a client asks one node on the data path (typed; the one header every transport sends).

The runtime (:mod:`adam_dask.ps.runtime`) and the client (:mod:`adam_dask.ps.client`) carry
them out; the simulation (:mod:`adam_dask.testing.simulation`) drives them with faults.
"""
