"""The controller's commands to a PS node, pure like
:class:`~adam_dask.ps.protocol.node_state.NodeState`: each ``on_*`` function takes the node's
state and a command and returns the actions to carry out. Hold shards, become a primary
(promoted, or rebuilt from the checkpoint), change backup lists, forget shards, flush.

Commands that arrive twice or late change nothing: a promotion or restore of a generation in
force is answered again, and backup lists carry a stamp (the controller's call id, which only
grows), so an older list never replaces a newer one.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ShardUnavailable
from .messages import (
    Action,
    AddBackups,
    Assign,
    Cancel,
    Drop,
    Fence,
    Flush,
    Peer,
    Promote,
    Reply,
    Restore,
    SetBackups,
    WriteDue,
)
from .node_data import forwards, on_write_due
from .node_state import NOT_HELD, NodeState, Waiter
from .shard import ShardState

logger = logging.getLogger(__name__)

__all__ = [
    "command",
    "on_add_backups",
    "on_assign",
    "on_drop",
    "on_flush",
    "on_promote",
    "on_restore",
    "on_set_backups",
]


def command(method: str, req: Any, args: tuple) -> Any:
    """The event of a controller's call ``method(*args)`` to a node (``restore`` excepted: its
    block is read from storage first)."""
    if method == "fence":
        return Fence(req, *args)
    if method == "promote":
        return Promote(req, *args)
    if method == "assign":
        return Assign(req, *args)
    if method == "add_backups":
        return AddBackups(req, *args)
    if method == "set_backups":
        return SetBackups(req, *args)
    raise ValueError(f"no PS node command {method!r}")


def on_assign(node: NodeState, ev: Assign) -> list[Action]:
    for sid, (start, stop) in ev.shards.items():
        gen = int(ev.gens[sid])
        if gen < node.gens.get(sid, NOT_HELD):
            continue
        if sid in node.primaries and sid not in ev.primaries and node.gens[sid] < gen:
            node.step_down(sid, gen, "assigned as a backup of a newer generation")
        if sid not in node.shards:
            node.shards[sid] = ShardState(
                sid,
                start,
                stop,
                None,
                ev.version,
                node.dedup_window,
                gen=gen,
                optimizer=node.optimizer,
            )
        node.gens[sid] = gen
    for sid, peers in ev.primaries.items():
        if sid in node.shards:
            node.primaries[sid] = [tuple(p) for p in peers]  # type: ignore[misc]
            node.written[sid] = node.shards[sid].version
    return [Reply(ev.req, None)]


def on_promote(node: NodeState, ev: Promote) -> list[Action]:
    done: dict[int, int] = {}
    for sid, (gen, peers) in ev.shards.items():
        st = node.shards.get(sid)
        if st is None or not node.member or gen < node.gens.get(sid, NOT_HELD):
            continue
        if sid in node.primaries and st.gen == gen:  # the same promotion again
            done[sid] = st.version
            continue
        node.gens[sid] = gen
        st.gen = gen
        node.primaries[sid] = [tuple(p) for p in peers]  # type: ignore[misc]
        node.adding.pop(sid, None)  # the survivors it lists are copies
        node.list_stamps[sid] = max(node.list_stamps.get(sid, 0), ev.stamp)
        node.written[sid] = -1  # the checkpoint holds another generation: write ours
        node.value_cache.pop(sid, None)
        for acked in node.acked.values():
            acked.pop(sid, None)
        done[sid] = st.version
        logger.info(
            "node %s: primary of shard %d at generation %d, version %d",
            node.addr,
            sid,
            gen,
            st.version,
        )
    return [Reply(ev.req, done), *forwards(node)]


def on_restore(node: NodeState, ev: Restore) -> list[Action]:
    if not node.member or ev.gen < node.gens.get(ev.sid, NOT_HELD):
        return [Reply(ev.req, ShardUnavailable(f"shard {ev.sid}: stale restore"))]
    held = node.shards.get(ev.sid)
    if held is not None and ev.sid in node.primaries and held.gen == ev.gen:
        return [Reply(ev.req, ev.version)]  # the same restore again: done already
    st = ShardState(
        ev.sid, ev.start, ev.stop, None, -1, node.dedup_window, gen=-1, optimizer=node.optimizer
    )
    st.install(ev.version, ev.values, ev.ids, gen=ev.gen, full=True, marks=ev.marks, state=ev.state)
    node.forget(ev.sid)
    node.shards[ev.sid] = st
    node.gens[ev.sid] = ev.gen
    node.primaries[ev.sid] = []
    node.written[ev.sid] = ev.version
    logger.warning(
        "node %s: shard %d rebuilt from the checkpoint at version %d (generation %d)",
        node.addr,
        ev.sid,
        ev.version,
        ev.gen,
    )
    return [Reply(ev.req, ev.version)]


def on_set_backups(node: NodeState, ev: SetBackups) -> list[Action]:
    return [Reply(ev.req, None), *set_backups(node, ev.shards, ev.stamp), *node.settle()]


def set_backups(node: NodeState, shards: dict[int, list[Peer]], stamp: int) -> list[Action]:
    """Make ``shards`` {sid: peers} the backup lists of those primaries, unless a list of a
    later stamp is in force already (a command that arrives late)."""
    out: list = []
    replaced: set[str] = set()
    for sid, peers in shards.items():
        if sid not in node.primaries or stamp < node.list_stamps.get(sid, 0):
            continue
        node.list_stamps[sid] = stamp
        new = [tuple(p) for p in peers]
        before = dict(node.primaries[sid])
        gone = set(before) - {a for a, _ in new}
        # another node on a backup's worker (the old one was lost and its worker came back):
        # what the old one held, and the answer to a forward on its way to it, say nothing
        # of the new one, which starts empty
        replaced |= {a for a, k in new if a in before and before[a] != k}
        node.primaries[sid] = new  # type: ignore[assignment]
        for addr in gone:
            node.acked.get(addr, {}).pop(sid, None)
    for addr in replaced:
        node.acked.pop(addr, None)
    wanted = {a for peers in node.primaries.values() for a, _ in peers}
    for addr in sorted((node.inflight - wanted) | (node.inflight & replaced)):
        node.inflight.discard(addr)
        out.append(Cancel(addr=addr))
    for addr in list(node.acked):
        if addr not in wanted:
            del node.acked[addr]
    return out


def on_add_backups(node: NodeState, ev: AddBackups) -> list[Action]:
    """Make ``shards`` {sid: peers} the backup lists; answer once the backups it adds hold the
    shard's current position: those new to a list (a node new on a listed worker too) and
    those an add listed that have not answered a forward of the shard since. A copy of the
    request, or a retry after an add whose answer was lost, finds the backup it adds listed
    already; it is no copy before it holds the shard (answered at once, the controller
    counted an empty node as a copy, and the primary's loss lost acknowledged pushes: seed
    41688). Backups listed otherwise are copies already and are not waited for (a lost one
    would hold the add until the list changes)."""
    need, backups = {}, {}
    for sid, peers in ev.shards.items():
        if sid not in node.primaries:
            return [Reply(ev.req, ShardUnavailable(f"not the primary of shard {sid}"))]
        if ev.stamp < node.list_stamps.get(sid, 0):
            return [Reply(ev.req, ShardUnavailable(f"a later backup list of {sid} is in force"))]
        need[sid] = node.shards[sid].version
        listed = {tuple(p) for p in node.primaries[sid]}
        named = {a for a, _ in peers}
        new = {a for a, k in peers if (a, k) not in listed}
        backups[sid] = new | (node.adding.get(sid, set()) & named)
    out = set_backups(node, ev.shards, ev.stamp)
    for sid, adds in backups.items():
        node.adding[sid] = (node.adding.get(sid, set()) & node.backups_of(sid)) | adds
    node.waiters.append(Waiter(ev.req, "add", need, backups=backups))
    return [*out, *forwards(node), *node.settle()]


def on_drop(node: NodeState, ev: Drop) -> list[Action]:
    for sid in ev.sids:
        node.forget(sid)
    return [Reply(ev.req, None), *node.settle()]


def on_flush(node: NodeState, ev: Flush) -> list[Action]:
    sids = list(node.primaries) if ev.sids is None else list(ev.sids)
    ok = [s for s in sids if node.accepts(s, None)]
    target = {s: node.shards[s].version for s in ok}
    moved = [s for s in sids if s not in ok]
    gens = {s: node.gens[s] for s in ok}
    written = ev.checkpoint and node.checkpoint
    node.waiters.append(Waiter(ev.req, "flush", target, moved, gens, written=written))
    out = node.settle() + forwards(node)
    if written:
        out += on_write_due(node, WriteDue())
    return out
