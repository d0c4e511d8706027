"""The controller's repair of a parameter server, pure like
:class:`~adam_dask.ps.protocol.controller.ServerState`, as functions of its state: what to call on
which node so that every shard has a primary and its copies again.

* a shard whose primary is gone: a new generation; every surviving copy is fenced with it and
  reports its position (a *round*); the newest is promoted, and only then named by the routing;
* a shard with no copy left: rebuilt from the checkpoint's block on a live node;
* a shard with too few copies: a new copy on a host it does not use (assigned, then added to
  the primary's backups, which sends it everything);
* a primary whose backups changed: told its new list (stamped, so a late list changes nothing).

One call per shard at a time (``busy``); a failed call backs off, a call to a lost node is
cancelled, and the next pass tries again.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .controller import Op, Round, ServerState
from .controller_manifest import manifest_actions
from .messages import Action, Call, CallDone, CallFailed, CreateNode, LogEvent, Peer
from .policy import choose_new_holder, choose_primary

logger = logging.getLogger(__name__)

__all__ = ["make_call", "on_call_done", "on_call_failed", "plan"]


def make_call(
    state: ServerState, kind: str, addr: str, sids: list[int], method: str, args: tuple, **kw: Any
) -> Call:
    involves = frozenset(kw.pop("involves", ())) | {addr}
    op = Op(next(state.op_ids), kind, addr, tuple(sids), involves, kw.pop("data", None))
    if method in ("promote", "set_backups", "add_backups"):
        args = (*args, op.op)  # the stamp that orders backup lists (op ids only grow)
    state.ops[op.op] = op
    if kind != "fence":
        for sid in sids:
            state.busy[sid] = op.op
    return Call(op.op, addr, state.nodes[addr], method, args)


def on_call_failed(state: ServerState, ev: CallFailed) -> list[Action]:
    op = state.ops.get(ev.op)
    if op is None:
        return []
    logger.warning("server %s: %s on %s failed: %s", state.server_id, op.kind, op.addr, ev.error)
    for sid in op.sids:
        state.backoff(("shard", sid))
    state.drop_op(op)  # the call is over: nothing to cancel
    return []


def on_call_done(state: ServerState, ev: CallDone) -> list[Action]:
    op = state.ops.pop(ev.op, None)
    if op is None:
        return []
    for sid in op.sids:
        if state.busy.get(sid) == op.op:
            del state.busy[sid]
        state.failures.pop(("shard", sid), None)
    done = {
        "fence": done_fence,
        "promote": done_promote,
        "restore": done_restore,
        "assign": done_assign,
        "add": done_add,
        "set_backups": done_set_backups,
    }
    return done[op.kind](state, op, ev.result)


def done_fence(state: ServerState, op: Op, result: dict) -> list[Action]:
    for sid in op.sids:
        rnd = state.rounds.get(sid)
        if rnd is None or rnd.gen != op.data[sid]:
            continue
        rnd.waiting.discard(op.addr)
        if sid in result:
            rnd.replies[op.addr] = tuple(result[sid])
        elif op.addr in state.routing[sid]:  # it does not hold the shard after all
            state.routing[sid].remove(op.addr)
    return []


def done_promote(state: ServerState, op: Op, result: dict) -> list[Action]:
    sid = op.sids[0]
    gen, others = op.data
    if sid not in result or op.addr not in state.nodes:
        state.needs_primary.add(sid)
        return []
    # the backups it was promoted with, each still the same node: one lost and back under the
    # same address meanwhile holds none of the shard (simulation seed 77505 of 100,000)
    state.routing[sid] = [op.addr] + [a for a, key in others if state.nodes.get(a) == key]
    state.gens[sid] = gen
    state.generation += 1
    state.needs_primary.discard(sid)
    logger.warning(
        "server %s: shard %d promoted on %s at generation %d, version %s",
        state.server_id,
        sid,
        op.addr,
        gen,
        result[sid],
    )
    return [
        LogEvent(
            {
                "event": "promoted",
                "server": state.server_id,
                "shard": sid,
                "worker": op.addr,
                "generation": gen,
            }
        )
    ]


def done_restore(state: ServerState, op: Op, result: Any) -> list[Action]:
    sid = op.sids[0]
    gen, version = op.data
    state.routing[sid] = [op.addr]
    state.gens[sid] = gen
    state.generation += 1
    state.restoring.discard(sid)
    seen = state.last_seen.get(sid, (-1, -1))[1]
    lost = max(0, seen - version)
    state.restored.append(
        {"shard": sid, "version": version, "generation": gen, "lost_at_least": lost}
    )
    logger.error(
        "server %s: every copy of shard %d was lost; rebuilt from the checkpoint at "
        "version %d on %s. It lacks the updates applied after that write-back (at least "
        "%d known from heartbeats); pushers with ack=replay hold them and replay them, "
        "others' are lost",
        state.server_id,
        sid,
        version,
        op.addr,
        lost,
    )
    return [
        LogEvent(
            {
                "event": "shard-restored",
                "server": state.server_id,
                "shard": sid,
                "version": version,
                "lost_at_least": lost,
            }
        )
    ]


def done_assign(state: ServerState, op: Op, result: Any) -> list[Action]:
    sid, (new, primary) = op.sids[0], op.data
    if state.routing[sid][:1] != [primary] or new not in state.nodes:
        return []
    peers = peers_of(state, state.routing[sid][1:] + [new])
    call = make_call(
        state, "add", primary, [sid], "add_backups", ({sid: peers},), involves=[new], data=new
    )
    return [call]


def done_add(state: ServerState, op: Op, result: Any) -> list[Action]:
    sid, new = op.sids[0], op.data
    holders = state.routing[sid]
    if holders[:1] == [op.addr] and new in state.nodes and new not in holders:
        holders.append(new)
        state.generation += 1
    return []


def done_set_backups(state: ServerState, op: Op, result: Any) -> list[Action]:
    return []


def plan(state: ServerState) -> list[Action]:
    """The next calls of the repair, for every shard not waiting for one."""
    out = manifest_actions(state)
    if (
        state.heal_started is None
        and not (state.backups_changed or state.needs_primary or state.rounds or state.restoring)
        and all(len(h) >= state.target for h in state.routing.values())
    ):
        return out  # nothing to repair (each step below would find nothing to do)
    live = state.live()
    load = Counter(a for h in state.routing.values() for a in h)
    out += plan_set_backups(state)
    out += plan_rounds(state)
    out += plan_restores(state, live, load)
    out += plan_copies(state, live, load)
    if state.heal_started is not None and state.healthy():
        took = state.now - state.heal_started
        state.heal_started = None
        state.heal_times.append(took)
        logger.warning(
            "server %s healed: every shard has %d copies again, %.2fs after the loss",
            state.server_id,
            state.target,
            took,
        )
        out.append(
            LogEvent(
                {
                    "event": "healed",
                    "server": state.server_id,
                    "seconds": took,
                    "generation": state.generation,
                }
            )
        )
    return out


def peers_of(state: ServerState, addrs: list[str]) -> list[tuple[str, str]]:
    return [(a, state.nodes[a]) for a in addrs if a in state.nodes]


def plan_set_backups(state: ServerState) -> list[Action]:
    out: list[Action] = []
    for sid in sorted(state.backups_changed):
        if sid in state.busy or sid in state.pending() or not state.ready(("shard", sid)):
            continue
        state.backups_changed.discard(sid)
        holders = state.routing[sid]
        if holders and holders[0] in state.nodes:
            args = ({sid: peers_of(state, holders[1:])},)
            out.append(make_call(state, "set_backups", holders[0], [sid], "set_backups", args))
    return out


def plan_rounds(state: ServerState) -> list[Action]:
    out: list = []
    primary_load = Counter(h[0] for s, h in state.routing.items() if h and s not in state.rounds)
    for sid, rnd in sorted(state.rounds.items()):
        if rnd.waiting:
            continue
        del state.rounds[sid]
        # a copy at version -1 was added and never filled (its primary died before the
        # first forward reached it): it holds nothing to promote
        cands = {a: p for a, p in rnd.replies.items() if a in state.nodes and p[1] >= 0}
        if not cands and rnd.replies and all(p[1] < 0 for p in rnd.replies.values()):
            # every survivor that answered is empty: the shard's data is where every
            # copy was lost, so rebuild it from the checkpoint (or report it lost)
            logger.warning(
                "server %s: the surviving copies of shard %d were never filled; "
                "rebuilding it as a shard whose every copy is lost",
                state.server_id,
                sid,
            )
            state.routing[sid] = []
            state.restoring.add(sid)
            continue
        if not cands:
            state.needs_primary.add(sid)
            continue
        new = choose_primary(cands, primary_load)
        primary_load[new] += 1
        others = peers_of(state, [a for a in state.routing[sid] if a != new])
        args = ({sid: (rnd.gen, others)},)
        out.append(make_call(state, "promote", new, [sid], "promote", args, data=(rnd.gen, others)))
    for sid in sorted(state.needs_primary - set(state.rounds)):
        if sid in state.busy:
            continue
        survivors = [a for a in state.routing[sid] if a in state.nodes]
        state.routing[sid] = survivors
        state.needs_primary.discard(sid)
        if not survivors:
            state.restoring.add(sid)
            continue
        state.generation += 1
        state.rounds[sid] = Round(state.generation, set(survivors), set(), {})
    asks: dict[str, dict[int, int]] = {}
    for sid, rnd in sorted(state.rounds.items()):
        for addr in sorted(rnd.waiting - rnd.asked):
            if addr in state.nodes and state.ready(("shard", sid)):
                asks.setdefault(addr, {})[sid] = rnd.gen
                rnd.asked.add(addr)
    for addr, gens in asks.items():
        out.append(make_call(state, "fence", addr, list(gens), "fence", (gens,), data=gens))
    return out


def plan_restores(state: ServerState, live: dict[str, str], load: Counter) -> list[Action]:
    out: list = []
    live = {a: h for a, h in live.items() if a in state.nodes or state.ready(("node", a))}
    for sid in sorted(state.restoring):
        if sid in state.busy or not state.ready(("shard", sid)):
            continue
        if state.manifest is None:
            state.restoring.discard(sid)
            state.lost.add(sid)
            logger.error(
                "server %s: every copy of shard %d is lost and there is no checkpoint",
                state.server_id,
                sid,
            )
            out.append(LogEvent({"event": "shard-lost", "server": state.server_id, "shard": sid}))
            continue
        target = choose_new_holder([], live, load, set(state.nodes))
        if target is None:
            continue
        if target not in state.nodes:
            out += create(state, target)
            continue
        load[target] += 1
        state.generation += 1
        start, stop = state.shards[sid]
        block = state.manifest.block(sid)
        args = (sid, state.generation, start, stop, block)
        data = (state.generation, block[2])
        out.append(make_call(state, "restore", target, [sid], "restore", args, data=data))
    return out


def plan_copies(state: ServerState, live: dict[str, str], load: Counter) -> list[Action]:
    out: list = []
    live = {a: h for a, h in live.items() if a in state.nodes or state.ready(("node", a))}
    for sid, holders in sorted(state.routing.items()):
        if (
            len(holders) >= state.target
            or not holders
            or holders[0] not in state.nodes
            or sid in state.busy
            or sid in state.pending()
            or sid in state.backups_changed
            or not state.ready(("shard", sid))
        ):
            continue
        new = choose_new_holder(holders, live, load, set(state.nodes))
        if new is None:
            continue
        if new not in state.nodes:
            out += create(state, new)
            continue
        load[new] += 1
        start, stop = state.shards[sid]
        no_backups: dict[int, list[Peer]] = {}
        args = ({sid: (start, stop)}, {sid: state.gens[sid]}, no_backups, -1)
        out.append(
            make_call(
                state,
                "assign",
                new,
                [sid],
                "assign",
                args,
                involves=[holders[0]],
                data=(new, holders[0]),
            )
        )
    return out


def create(state: ServerState, addr: str) -> list[Action]:
    if addr in state.creating or not state.ready(("node", addr)):
        return []
    state.creating.add(addr)
    return [CreateNode(addr)]
