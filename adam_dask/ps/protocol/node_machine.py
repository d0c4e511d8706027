"""A PS node's one entry point: :func:`handle` gives an event to its handler, chosen by the
event's type from a table mypy checks (:mod:`.node_data` for the data path, replication and
write-back, :mod:`.node_commands` for the controller's commands), and notes the events of note
in the node's story. The Dask actor (:mod:`adam_dask.ps.runtime.node`) and the simulation
(:mod:`adam_dask.testing.simulation`) call it; nothing else changes a node's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import node_commands as commands
from . import node_data as data
from .messages import (
    Action,
    AddBackups,
    Assign,
    Confirmed,
    Drop,
    Event,
    Fence,
    Flush,
    ForwardDone,
    ForwardDue,
    ForwardFailed,
    HeartbeatReply,
    Marks,
    Promote,
    Pull,
    Pushes,
    Replicate,
    Restore,
    SetBackups,
    Versions,
    WriteDone,
    WriteDue,
    WriteFailed,
    caused_by,
)
from .node_state import NodeState
from .story import shards_of

__all__ = ["handle"]

_HANDLERS: dict[type[Event], Callable[[NodeState, Any], list[Action]]] = {
    Pushes: data.on_pushes,
    Pull: data.on_pull,
    Confirmed: data.on_confirmed,
    Marks: data.on_marks,
    Versions: data.on_versions,
    ForwardDue: data.on_forward_due,
    ForwardDone: data.on_forward_done,
    ForwardFailed: data.on_forward_failed,
    Replicate: data.on_replicate,
    WriteDue: data.on_write_due,
    WriteDone: data.on_write_done,
    WriteFailed: data.on_write_failed,
    HeartbeatReply: data.on_heartbeat_reply,
    Fence: data.on_fence,
    Assign: commands.on_assign,
    Promote: commands.on_promote,
    Restore: commands.on_restore,
    SetBackups: commands.on_set_backups,
    AddBackups: commands.on_add_backups,
    Drop: commands.on_drop,
    Flush: commands.on_flush,
}

# the data path's events: in the story only when they change the node's role
_DATA_PATH: frozenset[type[Event]] = frozenset(
    {
        Pushes,
        Pull,
        Confirmed,
        Marks,
        Versions,
        ForwardDue,
        ForwardDone,
        Replicate,
        WriteDue,
        WriteDone,
        HeartbeatReply,
    }
)


def handle(node: NodeState, event: Event, *, validate: bool = False) -> list[Action]:
    """Apply ``event`` to ``node``; return the actions to carry out, in order, each stamped
    with the event's stimulus id. An event of note (every one but the data path's, which is
    noted only when it changes the node's role: a shard held, lost or stepped down from) goes
    into the node's story. ``validate``: check the node's invariants after it
    (``adam.ps.validate``)."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"a PS node does not handle {type(event).__name__}")
    role = (len(node.shards), len(node.primaries), node.member)
    stimulus = node.story.stimulus(event)
    actions = caused_by(handler(node, event), stimulus)
    if type(event) not in _DATA_PATH or role != (
        len(node.shards),
        len(node.primaries),
        node.member,
    ):
        touched = shards_of(event).union(*(shards_of(a) for a in actions))
        node.story.record(event, touched, actions, stimulus)
    if validate:
        node.validate()
    return actions
