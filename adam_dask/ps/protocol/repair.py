"""The controller's repair of a parameter server (a mixin of
:class:`~adam_dask.ps.protocol.controller.ServerState`, pure like it): what to call on which node so
that every shard has a primary and its copies again.

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
from dataclasses import dataclass
from typing import Any

from .messages import Call, CallDone, CallFailed, Cancel, CreateNode, LogEvent, Peer, Position
from .policy import choose_new_holder, choose_primary

logger = logging.getLogger(__name__)

__all__ = ["Repair"]


@dataclass
class _Op:
    """A call to a node the controller waits for."""

    op: int
    kind: str  # fence, promote, restore, assign, add, set_backups
    addr: str
    sids: tuple[int, ...]
    involves: frozenset[str]
    data: Any = None


@dataclass
class _Round:
    """The fencing of one shard's surviving copies before a promotion."""

    gen: int
    waiting: set[str]
    asked: set[str]
    replies: dict[str, Position]


class Repair:
    """The repair half of ServerState: planning calls and taking their answers."""

    server_id: str
    shards: list[tuple[int, int]]
    target: int
    routing: dict[int, list[str]]
    nodes: dict[str, str]
    gens: dict[int, int]
    generation: int
    manifest: Any
    now: float
    creating: set[str]
    needs_primary: set[int]
    rounds: dict[int, _Round]
    restoring: set[int]
    lost: set[int]
    backups_changed: set[int]
    busy: dict[int, int]
    ops: dict[int, _Op]
    failures: Counter
    last_seen: dict[int, Position]
    restored: list[dict]
    heal_started: float | None
    heal_times: list[float]
    _ids: Any

    def pending(self) -> set[int]:  # pragma: no cover - ServerState's
        raise NotImplementedError

    def healthy(self) -> bool:  # pragma: no cover - ServerState's
        raise NotImplementedError

    def live(self) -> dict[str, str]:  # pragma: no cover - ServerState's
        raise NotImplementedError

    def _backoff(self, key: Any) -> None:  # pragma: no cover - ServerState's
        raise NotImplementedError

    def _ready(self, key: Any) -> bool:  # pragma: no cover - ServerState's
        raise NotImplementedError

    def _manifest_actions(self) -> list:  # pragma: no cover - ServerState's
        raise NotImplementedError

    def _drop_op(self, op: _Op) -> list:
        self.ops.pop(op.op, None)
        for sid in op.sids:
            if self.busy.get(sid) == op.op:
                del self.busy[sid]
        if op.kind == "fence":
            for sid in op.sids:
                if sid in self.rounds:
                    self.rounds[sid].asked.discard(op.addr)
        elif op.kind == "promote":
            self.needs_primary.update(op.sids)
        elif op.kind == "restore":
            self.restoring.update(op.sids)
        elif op.kind == "set_backups":
            self.backups_changed.update(op.sids)
        return [Cancel(op=op.op)]

    def _call(
        self, kind: str, addr: str, sids: list[int], method: str, args: tuple, **kw: Any
    ) -> Call:
        involves = frozenset(kw.pop("involves", ())) | {addr}
        op = _Op(next(self._ids), kind, addr, tuple(sids), involves, kw.pop("data", None))
        if method in ("promote", "set_backups", "add_backups"):
            args = (*args, op.op)  # the stamp that orders backup lists (op ids only grow)
        self.ops[op.op] = op
        if kind != "fence":
            for sid in sids:
                self.busy[sid] = op.op
        return Call(op.op, addr, self.nodes[addr], method, args)

    def _on_CallFailed(self, ev: CallFailed) -> list:
        op = self.ops.get(ev.op)
        if op is None:
            return []
        logger.warning("server %s: %s on %s failed: %s", self.server_id, op.kind, op.addr, ev.error)
        for sid in op.sids:
            self._backoff(("shard", sid))
        self._drop_op(op)  # the call is over: nothing to cancel
        return []

    def _on_CallDone(self, ev: CallDone) -> list:
        op = self.ops.pop(ev.op, None)
        if op is None:
            return []
        for sid in op.sids:
            if self.busy.get(sid) == op.op:
                del self.busy[sid]
            self.failures.pop(("shard", sid), None)
        done = {
            "fence": self._done_fence,
            "promote": self._done_promote,
            "restore": self._done_restore,
            "assign": self._done_assign,
            "add": self._done_add,
            "set_backups": self._done_set_backups,
        }
        return done[op.kind](op, ev.result)

    def _done_fence(self, op: _Op, result: dict) -> list:
        for sid in op.sids:
            rnd = self.rounds.get(sid)
            if rnd is None or rnd.gen != op.data[sid]:
                continue
            rnd.waiting.discard(op.addr)
            if sid in result:
                rnd.replies[op.addr] = tuple(result[sid])
            elif op.addr in self.routing[sid]:  # it does not hold the shard after all
                self.routing[sid].remove(op.addr)
        return []

    def _done_promote(self, op: _Op, result: dict) -> list:
        sid = op.sids[0]
        gen, others = op.data
        if sid not in result or op.addr not in self.nodes:
            self.needs_primary.add(sid)
            return []
        self.routing[sid] = [op.addr] + [a for a in others if a in self.nodes]
        self.gens[sid] = gen
        self.generation += 1
        self.needs_primary.discard(sid)
        logger.warning(
            "server %s: shard %d promoted on %s at generation %d, version %s",
            self.server_id,
            sid,
            op.addr,
            gen,
            result[sid],
        )
        return [
            LogEvent(
                {
                    "event": "promoted",
                    "server": self.server_id,
                    "shard": sid,
                    "worker": op.addr,
                    "generation": gen,
                }
            )
        ]

    def _done_restore(self, op: _Op, result: Any) -> list:
        sid = op.sids[0]
        gen, version = op.data
        self.routing[sid] = [op.addr]
        self.gens[sid] = gen
        self.generation += 1
        self.restoring.discard(sid)
        seen = self.last_seen.get(sid, (-1, -1))[1]
        lost = max(0, seen - version)
        self.restored.append(
            {"shard": sid, "version": version, "generation": gen, "lost_at_least": lost}
        )
        logger.error(
            "server %s: every copy of shard %d was lost; rebuilt from the checkpoint at "
            "version %d on %s. It lacks the updates applied after that write-back (at least "
            "%d known from heartbeats); pushers with ack=replay hold them and replay them, "
            "others' are lost",
            self.server_id,
            sid,
            version,
            op.addr,
            lost,
        )
        return [
            LogEvent(
                {
                    "event": "shard-restored",
                    "server": self.server_id,
                    "shard": sid,
                    "version": version,
                    "lost_at_least": lost,
                }
            )
        ]

    def _done_assign(self, op: _Op, result: Any) -> list:
        sid, (new, primary) = op.sids[0], op.data
        if self.routing[sid][:1] != [primary] or new not in self.nodes:
            return []
        peers = self._peers(self.routing[sid][1:] + [new])
        call = self._call(
            "add", primary, [sid], "add_backups", ({sid: peers},), involves=[new], data=new
        )
        return [call]

    def _done_add(self, op: _Op, result: Any) -> list:
        sid, new = op.sids[0], op.data
        holders = self.routing[sid]
        if holders[:1] == [op.addr] and new in self.nodes and new not in holders:
            holders.append(new)
            self.generation += 1
        return []

    def _done_set_backups(self, op: _Op, result: Any) -> list:
        return []

    def _plan(self) -> list:
        """The next calls of the repair, for every shard not waiting for one."""
        out = self._manifest_actions()
        if (
            self.heal_started is None
            and not (self.backups_changed or self.needs_primary or self.rounds or self.restoring)
            and all(len(h) >= self.target for h in self.routing.values())
        ):
            return out  # nothing to repair (each step below would find nothing to do)
        live = self.live()
        load = Counter(a for h in self.routing.values() for a in h)
        out += self._plan_set_backups()
        out += self._plan_rounds()
        out += self._plan_restores(live, load)
        out += self._plan_copies(live, load)
        if self.heal_started is not None and self.healthy():
            took = self.now - self.heal_started
            self.heal_started = None
            self.heal_times.append(took)
            logger.warning(
                "server %s healed: every shard has %d copies again, %.2fs after the loss",
                self.server_id,
                self.target,
                took,
            )
            out.append(
                LogEvent(
                    {
                        "event": "healed",
                        "server": self.server_id,
                        "seconds": took,
                        "generation": self.generation,
                    }
                )
            )
        return out

    def _peers(self, addrs: list[str]) -> list[tuple[str, str]]:
        return [(a, self.nodes[a]) for a in addrs if a in self.nodes]

    def _plan_set_backups(self) -> list:
        out = []
        for sid in sorted(self.backups_changed):
            if sid in self.busy or sid in self.pending() or not self._ready(("shard", sid)):
                continue
            self.backups_changed.discard(sid)
            holders = self.routing[sid]
            if holders and holders[0] in self.nodes:
                args = ({sid: self._peers(holders[1:])},)
                out.append(self._call("set_backups", holders[0], [sid], "set_backups", args))
        return out

    def _plan_rounds(self) -> list:
        out: list = []
        primary_load = Counter(h[0] for s, h in self.routing.items() if h and s not in self.rounds)
        for sid, rnd in sorted(self.rounds.items()):
            if rnd.waiting:
                continue
            del self.rounds[sid]
            # a copy at version -1 was added and never filled (its primary died before the
            # first forward reached it): it holds nothing to promote
            cands = {a: p for a, p in rnd.replies.items() if a in self.nodes and p[1] >= 0}
            if not cands and rnd.replies and all(p[1] < 0 for p in rnd.replies.values()):
                # every survivor that answered is empty: the shard's data is where every
                # copy was lost, so rebuild it from the checkpoint (or report it lost)
                logger.warning(
                    "server %s: the surviving copies of shard %d were never filled; "
                    "rebuilding it as a shard whose every copy is lost",
                    self.server_id,
                    sid,
                )
                self.routing[sid] = []
                self.restoring.add(sid)
                continue
            if not cands:
                self.needs_primary.add(sid)
                continue
            new = choose_primary(cands, primary_load)
            primary_load[new] += 1
            others = [a for a in self.routing[sid] if a != new and a in self.nodes]
            args = ({sid: (rnd.gen, self._peers(others))},)
            out.append(self._call("promote", new, [sid], "promote", args, data=(rnd.gen, others)))
        for sid in sorted(self.needs_primary - set(self.rounds)):
            if sid in self.busy:
                continue
            survivors = [a for a in self.routing[sid] if a in self.nodes]
            self.routing[sid] = survivors
            self.needs_primary.discard(sid)
            if not survivors:
                self.restoring.add(sid)
                continue
            self.generation += 1
            self.rounds[sid] = _Round(self.generation, set(survivors), set(), {})
        asks: dict[str, dict[int, int]] = {}
        for sid, rnd in sorted(self.rounds.items()):
            for addr in sorted(rnd.waiting - rnd.asked):
                if addr in self.nodes and self._ready(("shard", sid)):
                    asks.setdefault(addr, {})[sid] = rnd.gen
                    rnd.asked.add(addr)
        for addr, gens in asks.items():
            out.append(self._call("fence", addr, list(gens), "fence", (gens,), data=gens))
        return out

    def _plan_restores(self, live: dict[str, str], load: Counter) -> list:
        out: list = []
        live = {a: h for a, h in live.items() if a in self.nodes or self._ready(("node", a))}
        for sid in sorted(self.restoring):
            if sid in self.busy or not self._ready(("shard", sid)):
                continue
            if self.manifest is None:
                self.restoring.discard(sid)
                self.lost.add(sid)
                logger.error(
                    "server %s: every copy of shard %d is lost and there is no checkpoint",
                    self.server_id,
                    sid,
                )
                out.append(
                    LogEvent({"event": "shard-lost", "server": self.server_id, "shard": sid})
                )
                continue
            target = choose_new_holder([], live, load, set(self.nodes))
            if target is None:
                continue
            if target not in self.nodes:
                out += self._create(target)
                continue
            load[target] += 1
            self.generation += 1
            start, stop = self.shards[sid]
            block = self.manifest.block(sid)
            args = (sid, self.generation, start, stop, block)
            data = (self.generation, block[2])
            out.append(self._call("restore", target, [sid], "restore", args, data=data))
        return out

    def _plan_copies(self, live: dict[str, str], load: Counter) -> list:
        out: list = []
        live = {a: h for a, h in live.items() if a in self.nodes or self._ready(("node", a))}
        for sid, holders in sorted(self.routing.items()):
            if (
                len(holders) >= self.target
                or not holders
                or holders[0] not in self.nodes
                or sid in self.busy
                or sid in self.pending()
                or sid in self.backups_changed
                or not self._ready(("shard", sid))
            ):
                continue
            new = choose_new_holder(holders, live, load, set(self.nodes))
            if new is None:
                continue
            if new not in self.nodes:
                out += self._create(new)
                continue
            load[new] += 1
            start, stop = self.shards[sid]
            no_backups: dict[int, list[Peer]] = {}
            args = ({sid: (start, stop)}, {sid: self.gens[sid]}, no_backups, -1)
            out.append(
                self._call(
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

    def _create(self, addr: str) -> list:
        if addr in self.creating or not self._ready(("node", addr)):
            return []
        self.creating.add(addr)
        return [CreateNode(addr)]
