"""A PS node's data path, replication and write-back, pure like :class:`NodeState`: each
``on_*`` function takes the node's state and an event and returns the actions to carry out.

* **Apply** (:func:`on_pushes`): a primary applies a push when the pusher's stamp is the
  shard's generation, else reports the shard ``moved``; it answers at once with what every copy
  holds (``confirmed``) and what also the checkpoint holds (``durable``), or, with
  ``ack="all"``, once every backup holds the push.
* **Forward** (:func:`forwards`): each backup gets, one forward at a time, the newest values of
  every shard that changed since the position it last reported, with the push ids applied since.
* **Fence** (:func:`on_replicate`, :func:`on_fence`, :func:`on_heartbeat_reply`): generations
  only grow; a primary told of a newer one steps down.
* **Write back** (:func:`on_write_due`, :func:`on_write_done`): blocks of the dirty primaries;
  the controller names a block in the manifest only when the writer's generation is current.
"""

from __future__ import annotations

import logging

import numpy as np

from ...errors import UpdateRejected
from .messages import (
    Action,
    Confirmed,
    Fence,
    Forward,
    ForwardDone,
    ForwardDue,
    ForwardFailed,
    HeartbeatReply,
    Marks,
    Position,
    Pull,
    Push,
    Pushes,
    Replicate,
    Reply,
    Versions,
    WriteBlocks,
    WriteDone,
    WriteDue,
    WriteFailed,
)
from .node_state import NOT_HELD, NOT_MEMBER, NOWHERE, RESEND, NodeState, Waiter
from .replies import (
    ConfirmedReply,
    MarksReply,
    PullReply,
    PushReply,
    ReplicateReply,
    VersionsReply,
)
from .shard import Mark

logger = logging.getLogger(__name__)

__all__ = [
    "forwards",
    "on_confirmed",
    "on_fence",
    "on_forward_done",
    "on_forward_due",
    "on_forward_failed",
    "on_heartbeat_reply",
    "on_marks",
    "on_pull",
    "on_pushes",
    "on_replicate",
    "on_versions",
    "on_write_done",
    "on_write_due",
    "on_write_failed",
]


def on_pushes(node: NodeState, ev: Pushes) -> list[Action]:
    out: list = []
    todo: dict[int, list[tuple[int, np.ndarray | None, int | None, Mark | None, int | None]]]
    todo = {}
    results: list[tuple[int, Push, list[int]]] = []  # (index, push, its shards moved)
    for i, p in enumerate(ev.items):
        moved: list[int] = []
        checked: dict[int, np.ndarray | None] = {}
        try:
            for sid, d in p.deltas.items():
                sid = int(sid)
                if node.accepts(sid, p.stamps):
                    checked[sid] = node.shards[sid].check(d, scan=not p.scanned)
                else:
                    moved.append(sid)
        except UpdateRejected as exc:
            out.append(Reply(p.req, exc))
            continue
        bases = p.bases or {}
        if bases and checked:
            node.pushes_with_bases += 1
        for sid, d in checked.items():
            todo.setdefault(sid, []).append((i, d, p.push_id, p.mark, bases.get(sid)))
        results.append((i, p, moved))
    versions: dict[tuple[int, int], int] = {}
    for sid, items in todo.items():
        st = node.shards[sid]
        fenced = st.pushes_fenced
        applied = st.apply_batch(
            [it[1] for it in items],
            [it[2] for it in items],
            [it[3] for it in items],
            checked=True,
            bases=[it[4] for it in items],
        )
        n = len(items) - (st.pushes_fenced - fenced)
        node.pushes += n
        node.floats_applied += n * st.size
        for it, v in zip(items, applied):
            versions[(it[0], sid)] = v
    urgent = False
    for i, p, moved in results:
        per_shard: dict[int, int] = {}
        for sid in p.deltas:
            if (i, int(sid)) in versions:
                per_shard[int(sid)] = versions[(i, int(sid))]
        if p.ack == "all" and per_shard:
            node.waiters.append(Waiter(p.req, "push", per_shard, moved))
            urgent = True
        else:
            reply = PushReply(
                per_shard,
                tuple(moved),
                confirmed={s: node.confirmed(s) for s in per_shard},
                durable={s: node.durable(s) for s in per_shard},
                gens={s: node.gens[s] for s in per_shard},
            )
            out.append(Reply(p.req, reply))
    if urgent:
        out += node.settle()
        out += forwards(node)
    return out


def on_pull(node: NodeState, ev: Pull) -> list[Action]:
    ok = [s for s in ev.sids if node.accepts(s, ev.stamps)]
    moved = tuple(s for s in ev.sids if s not in ok)
    read = {s: node.values_of(s) for s in ok}
    per_shard: dict[int, np.ndarray | None] = {s: v for s, (_, v) in read.items()}
    versions = {s: pos[1] for s, (pos, _) in read.items()}
    return [Reply(ev.req, PullReply(per_shard, moved, versions))]


def on_marks(node: NodeState, ev: Marks) -> list[Action]:
    ok = [s for s in ev.sids if node.accepts(s, None)]
    moved = tuple(s for s in ev.sids if s not in ok)
    return [Reply(ev.req, MarksReply({s: node.shards[s].marks_of(ev.epoch) for s in ok}, moved))]


def on_confirmed(node: NodeState, ev: Confirmed) -> list[Action]:
    ok = [s for s in ev.sids if node.accepts(s, None)]
    reply = ConfirmedReply(
        {s: node.confirmed(s) for s in ok},
        {s: node.durable(s) for s in ok},
        {s: node.gens[s] for s in ok},
        tuple(s for s in ev.sids if s not in ok),
    )
    return [Reply(ev.req, reply)]


def on_versions(node: NodeState, ev: Versions) -> list[Action]:
    """The versions of the primaries among ``sids`` (:class:`VersionsReply`), or with
    ``primaries_only`` False of every shard held among them (``{sid: version}``)."""
    value: VersionsReply | dict[int, int]
    if ev.primaries_only:
        sids = list(node.primaries) if ev.sids is None else list(ev.sids)
        ok = [s for s in sids if node.accepts(s, None)]
        value = VersionsReply(
            {s: node.shards[s].version for s in ok}, tuple(s for s in sids if s not in ok)
        )
    else:
        sids = list(node.shards) if ev.sids is None else [s for s in ev.sids]
        value = {s: node.shards[s].version for s in sids if s in node.shards}
    return [Reply(ev.req, value)]


def on_forward_due(node: NodeState, ev: ForwardDue) -> list[Action]:
    return forwards(node)


def forwards(node: NodeState, only: set[str] | None = None) -> list[Action]:
    """A forward to every idle backup that is behind on some shard."""
    if not node.member:
        return []
    per_backup: dict[str, list] = {}
    keys: dict[str, str] = {}
    for sid, peers in node.primaries.items():
        st = node.shards[sid]
        for addr, key in peers:
            if addr in node.inflight or (only is not None and addr not in only):
                continue
            held = node.acked.get(addr, {}).get(sid, NOWHERE)
            if held >= st.position:
                continue
            since = held[1] if held[0] == st.gen else -1
            per_backup.setdefault(addr, []).append(st.snapshot(since, node.values_of(sid)[1]))
            keys[addr] = key
    out: list[Action] = []
    for addr, snaps in per_backup.items():
        node.inflight.add(addr)
        out.append(Forward(addr, keys[addr], tuple(snaps)))
    return out


def on_forward_done(node: NodeState, ev: ForwardDone) -> list[Action]:
    node.inflight.discard(ev.backup)
    acked = node.acked.setdefault(ev.backup, {})
    for sid, pos in ev.held.items():
        # only the node listed for the shard counts: the late answer of one its worker has
        # replaced by a new, empty node says nothing of the new one (an address may be listed
        # under the old key for one shard and the new for another while the lists change)
        if ev.backup in node.backups_of(sid) and (
            ev.key is None or (ev.backup, ev.key) in {tuple(p) for p in node.primaries[sid]}
        ):
            gen, version = pos  # a list if it came over the network
            acked[sid] = max(acked.get(sid, NOWHERE), (gen, version))
            node.adding.get(sid, set()).discard(ev.backup)  # it holds the shard now
    for sid, gen in ev.refused.items():
        if gen == RESEND:  # the backup holds less than the record says: start it over
            acked.pop(sid, None)
        elif sid in node.primaries and gen > node.gens[sid]:
            node.step_down(sid, gen, f"backup {ev.backup} knows generation {gen}")
    out = node.settle()
    if any(ev.backup in b for w in node.waiters for b in node.waited_backups(w)):
        out += forwards(node, {ev.backup})
    return out


def on_forward_failed(node: NodeState, ev: ForwardFailed) -> list[Action]:
    node.inflight.discard(ev.backup)
    node.forward_errors += 1
    return []


def on_replicate(node: NodeState, ev: Replicate) -> list[Action]:
    held: dict[int, Position] = {}
    refused: dict[int, int] = {}
    for snap in ev.snaps:
        sid = snap.shard
        st = node.shards.get(sid)
        known = node.gens.get(sid, NOT_HELD)
        if st is None or not node.member:
            refused[sid] = NOT_HELD
            continue
        if snap.gen < known or (sid in node.primaries and snap.gen == known):
            refused[sid] = known
            node.refused_stale += 1
            logger.info(
                "node %s: refused a forward of shard %d from %s (generation %d, I know %d)",
                node.addr,
                sid,
                ev.sender,
                snap.gen,
                known,
            )
            continue
        if snap.gap(st.position):  # its push ids would have a gap: ask for a whole copy
            refused[sid] = RESEND
            continue
        if sid in node.primaries:  # a newer primary exists: this one is a backup now
            node.step_down(sid, snap.gen, f"{ev.sender} forwards generation {snap.gen}")
        node.gens[sid] = max(known, snap.gen)
        st.install(
            snap.version,
            snap.values,
            snap.ids,
            gen=snap.gen,
            full=snap.full,
            marks=snap.marks,
            state=snap.state,
        )
        held[sid] = st.position
    return [Reply(ev.req, ReplicateReply(held, refused)), *node.settle()]


def on_write_due(node: NodeState, ev: WriteDue) -> list[Action]:
    if not node.checkpoint or node.writing or not node.member:
        return []
    dirty = [s for s in node.primaries if node.shards[s].version > node.written.get(s, -1)]
    if not dirty:
        return []
    node.writing = True
    node.writing_gens = {s: node.shards[s].gen for s in dirty}
    return [WriteBlocks(tuple(node.shards[s].snapshot(-1, node.values_of(s)[1]) for s in dirty))]


def on_write_done(node: NodeState, ev: WriteDone) -> list[Action]:
    node.writing = False
    wrote, node.writing_gens = node.writing_gens, {}
    for sid, version in ev.accepted.items():
        if sid in node.primaries:
            node.written[sid] = max(node.written.get(sid, -1), int(version))
            node.floats_written += node.shards[sid].stop - node.shards[sid].start
    for sid, gen in ev.refused.items():
        if gen == NOT_MEMBER:
            node.retire("the controller refused a write-back")
        elif sid in node.primaries:
            if deposed_by(node, gen, sid, wrote.get(sid)):
                node.step_down(sid, gen, "the controller refused its write-back")
            else:
                logger.info(
                    "node %s: the controller refused a block of shard %d of generation %s; "
                    "still its primary at generation %d",
                    node.addr,
                    sid,
                    wrote.get(sid),
                    node.gens[sid],
                )
    return node.settle()


def deposed_by(node: NodeState, gen: int, sid: int, wrote: int | None) -> bool:
    """Whether the refusal of a block of primary ``sid`` written at generation ``wrote``,
    naming generation ``gen``, means another primary: a newer generation than this node
    knows, or this node's own generation when the block was of it too (the controller
    does not count this node as that generation's primary). A block of an older
    generation proves nothing about the newer one: the node may have been fenced and
    promoted again since it wrote it (its promotion's answer lost), and the generation
    the refusal names, that of the controller's round then, may be its own now. A node
    that stepped down on it would be named by the routing as the primary and refuse
    every push and every new backup for good."""
    if gen > node.gens[sid]:
        return True
    return gen == node.gens[sid] and wrote == gen


def on_write_failed(node: NodeState, ev: WriteFailed) -> list[Action]:
    node.writing = False
    node.writeback_errors += 1
    node.last_writeback_error = ev.error
    return []


def on_heartbeat_reply(node: NodeState, ev: HeartbeatReply) -> list[Action]:
    if not ev.member:
        if node.member:
            node.retire("the controller no longer counts this node")
        return node.settle()
    for sid, gen in ev.gens.items():
        if gen > node.gens.get(sid, NOT_HELD):
            if sid in node.primaries:
                node.step_down(sid, gen, "the controller knows a newer generation")
            elif sid in node.shards:
                node.gens[sid] = gen
    return node.settle()


def on_fence(node: NodeState, ev: Fence) -> list[Action]:
    positions = {}
    for sid, gen in ev.gens.items():
        if sid not in node.shards:
            continue
        if sid in node.primaries and gen > node.gens[sid]:
            node.step_down(sid, gen, "fenced by the controller")
        node.gens[sid] = max(node.gens[sid], gen)
        positions[sid] = node.shards[sid].position
    return [Reply(ev.req, positions), *node.settle()]
