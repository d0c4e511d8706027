"""The controller's one entry point: :func:`handle` gives an event to its handler, chosen by the
event's type from a table mypy checks (:class:`~.controller.ServerState`'s answers to
membership, heartbeats, write-backs and the manifest; :mod:`.repair`'s to the calls it made),
then lets the repair plan its next calls, and notes the event in the controller's story. The
scheduler plugin (:mod:`adam_dask.ps.runtime.plugin`) and the simulation call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import controller_manifest as manifest
from . import repair
from .controller import ServerState
from .messages import (
    Action,
    Beat,
    Call,
    CallDone,
    CallFailed,
    Commit,
    Event,
    ManifestDone,
    ManifestFailed,
    NodeFailed,
    NodeReady,
    Reply,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    WriteReport,
    caused_by,
)
from .story import shards_of

__all__ = ["handle"]

_HANDLERS: dict[type[Event], Callable[[ServerState, Any], list[Action]]] = {
    WorkerAdded: ServerState.on_worker_added,
    WorkerRemoved: ServerState.on_worker_removed,
    Beat: ServerState.on_beat,
    Tick: ServerState.on_tick,
    NodeReady: ServerState.on_node_ready,
    NodeFailed: ServerState.on_node_failed,
    WriteReport: manifest.on_write_report,
    Commit: manifest.on_commit,
    ManifestDone: manifest.on_manifest_done,
    ManifestFailed: manifest.on_manifest_failed,
    CallDone: repair.on_call_done,
    CallFailed: repair.on_call_failed,
}


def handle(state: ServerState, event: Event, *, validate: bool = False) -> list[Action]:
    """Apply ``event``; return the actions to carry out, in order: the handler's, then the
    repair's next calls, each stamped with the event's stimulus id. Every event but a tick or a
    heartbeat that only gets its reply goes into the controller's story, the shards of its
    calls named. ``validate``: check the controller's invariants after it (``adam.ps.validate``)."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"the PS controller does not handle {type(event).__name__}")
    stimulus = state.story.stimulus(event)
    out = caused_by(handler(state, event) + repair.plan(state), stimulus)
    if type(event) not in (Tick, Beat) or any(not isinstance(a, Reply) for a in out):
        touched = shards_of(event)
        for a in out:
            op = state.ops.get(a.op) if isinstance(a, Call) else None
            touched.update(op.sids if op is not None else shards_of(a))
        state.story.record(event, touched, out, stimulus)
    if validate:
        state.validate()
    return out
