"""Events and actions of the parameter-server protocol, as small frozen dataclasses.

The node (:mod:`adam_dask.ps.protocol.node_state`) and the controller (:mod:`adam_dask.ps.protocol.controller`)
are pure state machines: ``handle(event)`` changes their state and returns the actions to carry
out. The Dask actor (:mod:`adam_dask.ps.runtime.node`), the scheduler plugin
(:mod:`adam_dask.ps.runtime.plugin`) and the simulator (:mod:`adam_dask.testing.simulation`) feed them events
and carry the actions out; nothing else changes protocol state.

``req`` fields are opaque tokens of the caller: a :class:`Reply` with the same token answers
the request. Positions are ``(gen, version)`` pairs: the generation of the primary that
produced a shard's values, and the number of updates in them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .shard import Mark, ShardCopy

__all__ = [
    "Action",
    "AddBackups",
    "Assign",
    "Beat",
    "Call",
    "CallDone",
    "CallFailed",
    "Cancel",
    "Commit",
    "Confirmed",
    "CreateNode",
    "DeleteBlocks",
    "Drop",
    "Event",
    "Fence",
    "Flush",
    "Forward",
    "ForwardDone",
    "ForwardDue",
    "ForwardFailed",
    "HeartbeatReply",
    "LogEvent",
    "ManifestDone",
    "ManifestFailed",
    "Marks",
    "NodeFailed",
    "NodeReady",
    "Promote",
    "Pull",
    "Push",
    "Pushes",
    "Replicate",
    "Reply",
    "Restore",
    "Retire",
    "SetBackups",
    "Tick",
    "Versions",
    "WorkerAdded",
    "WorkerRemoved",
    "WriteBlocks",
    "WriteDone",
    "WriteDue",
    "WriteFailed",
    "WriteManifest",
    "WriteReport",
    "caused_by",
]

Position = tuple[int, int]
Peer = tuple[str, str]  # (worker address, node actor key)


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened, handed to a state machine's ``handle``. ``stimulus_id`` names
    its cause (the machine makes one when the caller gives none): the same id on the actions
    it leads to and in the machine's story."""

    stimulus_id: str = field(default="", kw_only=True, compare=False)


@dataclass(frozen=True, slots=True)
class Action:
    """What a state machine asks its runtime to carry out. ``stimulus_id`` is its cause's: the
    machine's ``handle`` stamps each action with the id of the event that led to it, and the
    runtime hands it on to what the action's outcome feeds back (a call's answer, a forward's,
    a write's), across processes too (a controller's call to a node)."""

    stimulus_id: str = field(default="", kw_only=True, compare=False)


def caused_by(actions: list[Action], stimulus_id: str) -> list[Action]:
    """Stamp ``actions`` with ``stimulus_id`` (those without one of their own); returns them.
    Actions are frozen to their runtime; the machine that made them stamps them once, here."""
    for a in actions:
        if not a.stimulus_id:
            object.__setattr__(a, "stimulus_id", stimulus_id)
    return actions


# -- node events -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Push:
    """One push at a primary: ``deltas`` {sid: shard-length float32 delta, or None for zeros}, ``stamps`` {sid:
    the shard generation in the pusher's routing}; ``ack`` is "replay", "all" or "primary";
    ``mark`` what it covers of the pusher's data (recorded with it, fences repeats);
    ``bases`` {sid: the version of the shard the pusher last read}, for the server
    optimizer's staleness (None, or a shard left out: not known)."""

    req: Any
    deltas: dict[int, np.ndarray | None]
    push_id: int | None
    stamps: dict[int, int] | None
    ack: str
    mark: Mark | None = None
    scanned: bool = False  # the pusher checked the values (NaN/Inf): only lengths are checked
    bases: dict[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Pushes(Event):
    """The pushes that arrived during one turn of the event loop, applied as one batch."""

    items: tuple[Push, ...]


@dataclass(frozen=True, slots=True)
class Pull(Event):
    req: Any
    sids: tuple[int, ...]
    stamps: dict[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Confirmed(Event):
    """What every copy of each primary among ``sids`` holds (a pusher's question)."""

    req: Any
    sids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Marks(Event):
    """The data positions (:class:`~adam_dask.ps.protocol.shard.Mark`) of ``epoch`` recorded by each
    primary among ``sids``."""

    req: Any
    sids: tuple[int, ...]
    epoch: int


@dataclass(frozen=True, slots=True)
class Versions(Event):
    req: Any
    sids: tuple[int, ...] | None = None
    primaries_only: bool = False


@dataclass(frozen=True, slots=True)
class ForwardDue(Event):
    """Timer: time to send what changed to the backups."""


@dataclass(frozen=True, slots=True)
class ForwardDone(Event):
    """A backup answered a forward: ``held`` {sid: position it holds now}, ``refused`` {sid:
    the generation it knows, newer than the one sent, or -1 when it does not hold the shard};
    ``key``: the node the forward went to (None: not said)."""

    backup: str
    held: dict[int, Position]
    refused: dict[int, int]
    key: str | None = None


@dataclass(frozen=True, slots=True)
class ForwardFailed(Event):
    backup: str
    error: str


@dataclass(frozen=True, slots=True)
class Replicate(Event):
    """A forward arriving at a backup from ``sender``."""

    req: Any
    sender: str
    snaps: tuple[ShardCopy, ...]


@dataclass(frozen=True, slots=True)
class WriteDue(Event):
    """Timer: time to write dirty primaries back to the checkpoint."""


@dataclass(frozen=True, slots=True)
class WriteDone(Event):
    """The controller's answer to a write-back report: {sid: version} accepted (named by the
    manifest), {sid: generation} refused because the writer's generation is stale."""

    accepted: dict[int, int]
    refused: dict[int, int]


@dataclass(frozen=True, slots=True)
class WriteFailed(Event):
    error: str


@dataclass(frozen=True, slots=True)
class HeartbeatReply(Event):
    """The controller's answer to a heartbeat: whether this node still belongs to the server,
    and the current generation of the shards it holds."""

    member: bool
    gens: dict[int, int]


@dataclass(frozen=True, slots=True)
class Assign(Event):
    """Hold ``shards`` {sid: (start, stop)} at ``gens`` {sid: gen}; be primary of those in
    ``primaries`` {sid: [peers]} (its backups)."""

    req: Any
    shards: dict[int, tuple[int, int]]
    gens: dict[int, int]
    primaries: dict[int, list[Peer]] = field(default_factory=dict)
    version: int = 0


@dataclass(frozen=True, slots=True)
class Fence(Event):
    """Refuse anything of ``gens`` {sid: gen}'s older generations; answer the positions held."""

    req: Any
    gens: dict[int, int]


@dataclass(frozen=True, slots=True)
class Promote(Event):
    """Become the primary of each shard {sid: (gen, [backup peers])}. ``stamp`` orders the
    controller's backup lists: an older list arriving late changes nothing."""

    req: Any
    shards: dict[int, tuple[int, list[Peer]]]
    stamp: int = 0


@dataclass(frozen=True, slots=True)
class Restore(Event):
    """Become the primary of a shard rebuilt from the checkpoint (values read by the actor)."""

    req: Any
    sid: int
    gen: int
    start: int
    stop: int
    version: int
    values: np.ndarray
    ids: tuple[tuple[int, int], ...]
    marks: tuple[Mark, ...] = ()
    state: np.ndarray | None = None  # the server optimizer's state in the block (momentum)

    @classmethod
    def of_block(cls, req: Any, sid: int, gen: int, start: int, stop: int, b: ShardCopy) -> Restore:
        """The restore of ``sid`` at ``gen`` from the checkpoint block read as ``b``."""
        return cls(
            req, sid, gen, int(start), int(stop), b.version, b.values, b.ids, b.marks, b.state
        )


@dataclass(frozen=True, slots=True)
class SetBackups(Event):
    req: Any
    shards: dict[int, list[Peer]]
    stamp: int = 0


@dataclass(frozen=True, slots=True)
class AddBackups(Event):
    """Set backup lists; answer once the new backups hold the shard's current position."""

    req: Any
    shards: dict[int, list[Peer]]
    stamp: int = 0


@dataclass(frozen=True, slots=True)
class Drop(Event):
    req: Any
    sids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Flush(Event):
    """Answer once every copy (and, with a checkpoint, the manifest) holds the current version
    of each primary among ``sids`` (all primaries when None)."""

    req: Any
    sids: tuple[int, ...] | None
    checkpoint: bool


# -- node actions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply(Action):
    """Answer request ``req`` with ``value`` (an exception instance is raised to the caller)."""

    req: Any
    value: Any


@dataclass(frozen=True, slots=True)
class Forward(Action):
    """Send ``snaps`` to the backup ``addr`` (actor ``key``); answer with ForwardDone/Failed."""

    addr: str
    key: str
    snaps: tuple[ShardCopy, ...]


@dataclass(frozen=True, slots=True)
class Cancel(Action):
    """Stop waiting for the forward to ``addr`` (node) or the call ``op`` (controller)."""

    addr: str | None = None
    op: int | None = None


@dataclass(frozen=True, slots=True)
class WriteBlocks(Action):
    """Write each snapshot as a checkpoint block, then report them to the controller; answer
    with WriteDone/WriteFailed."""

    snaps: tuple[ShardCopy, ...]


# -- controller events -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerAdded(Event):
    addr: str
    host: str
    now: float


@dataclass(frozen=True, slots=True)
class WorkerRemoved(Event):
    addr: str
    now: float


@dataclass(frozen=True, slots=True)
class Beat(Event):
    """A node's heartbeat: the positions of the shards it is primary of."""

    req: Any
    addr: str
    key: str
    now: float
    positions: dict[int, Position]


@dataclass(frozen=True, slots=True)
class Tick(Event):
    now: float


@dataclass(frozen=True, slots=True)
class CallDone(Event):
    op: int
    result: Any


@dataclass(frozen=True, slots=True)
class CallFailed(Event):
    op: int
    error: str


@dataclass(frozen=True, slots=True)
class NodeReady(Event):
    addr: str
    key: str
    now: float


@dataclass(frozen=True, slots=True)
class NodeFailed(Event):
    addr: str
    error: str


@dataclass(frozen=True, slots=True)
class WriteReport(Event):
    """A primary wrote blocks: {sid: (gen, version, block path)}."""

    req: Any
    addr: str
    blocks: dict[int, tuple[int, int, str]]


@dataclass(frozen=True, slots=True)
class ManifestDone(Event):
    seq: int


@dataclass(frozen=True, slots=True)
class ManifestFailed(Event):
    seq: int
    error: str
    now: float


@dataclass(frozen=True, slots=True)
class Commit(Event):
    """Store ``epoch``/``meta`` (when not None) in the manifest and answer once it is written."""

    req: Any
    epoch: Any
    meta: dict | None


# -- controller actions ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call(Action):
    """Call ``method(*args)`` on the node at ``addr`` (actor ``key``); answer with
    CallDone/CallFailed carrying ``op``."""

    op: int
    addr: str
    key: str
    method: str
    args: tuple


@dataclass(frozen=True, slots=True)
class CreateNode(Action):
    """Create this server's node actor on the worker ``addr``; answer NodeReady/NodeFailed."""

    addr: str


@dataclass(frozen=True, slots=True)
class Retire(Action):
    """Remove the worker ``addr`` from the cluster (it missed its heartbeats)."""

    addr: str


@dataclass(frozen=True, slots=True)
class WriteManifest(Action):
    """Write ``doc`` as the checkpoint's manifest; answer ManifestDone/ManifestFailed."""

    seq: int
    doc: dict


@dataclass(frozen=True, slots=True)
class DeleteBlocks(Action):
    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LogEvent(Action):
    """Tell clients (the ``adam-ps`` event topic)."""

    msg: dict
