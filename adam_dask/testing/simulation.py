"""A deterministic simulation of the parameter-server protocol, on the pure state machines.

:func:`simulate` runs, from one seed, a few PS nodes (:class:`~adam_dask.ps.protocol.node_state.NodeState`),
the controller (:class:`~adam_dask.ps.protocol.controller.ServerState`) and several pushers over a
simulated network and clock: messages are delayed, reordered, dropped and duplicated; nodes are
killed (their worker comes back under a new address, empty), frozen (sockets open, nothing
answers; after a while they wake and act on what they knew) and storage has outages. Every
choice comes from ``random.Random(seed)``, so a seed replays exactly.

The pushers run the client's code: each holds a :class:`~adam_dask.ps.protocol.routing.Routing` (set
from the controller's routing where the client reads the scheduler), a
:class:`~adam_dask.ps.protocol.replay.ReplayLog` and the courier's plans
(:mod:`~adam_dask.ps.protocol.courier_plan`) within a byte budget (``replay_bytes``; drawn apart
from the seed's stream, a few pushes in a quarter of the seeds), and carries out their steps as
the client's courier does: a push (room made under the budget, what moved replayed, the push),
the replay of held pushes to a new primary (same push ids) before whatever comes next, and,
while pushes are held, the settler's rounds (the routing read again, the replays, the
``confirmed`` question). Each request walks through a
:class:`~adam_dask.ps.protocol.request.Delivery`: its sends are the simulated calls to the nodes;
their answers, and the calls lost, timed out or made to a node the controller dropped, go back
to it; a refresh reads the routing again; the replay log takes the answers with the courier's
rules.

After every step it checks:

* **at most once**: no copy of a shard, and no checkpoint block, holds any push twice;
* **nothing acknowledged lost**: every push a pusher was told is applied is held by a live copy
  the controller routes to, by the pusher itself (not yet durable), or by the checkpoint;
  it may be missing for a while only when every copy of its shard is lost, and then only if
  the shard's restore from the checkpoint accounts for it; with ``ack="replay"`` the pusher
  replays it to the restored shard, so at the end it is there, unless the pusher let go of it
  over its byte budget (every copy held it then);
* **the manifest never goes back**: sequence numbers and each shard's ``(generation, version)``
  only grow, and every block the newest manifest names exists;
* **the protocol heals within a bound**: at most :data:`HEAL_BOUND` (30) simulated seconds after
  the end of the last fault so far (a crash; the thaw of a freeze; the end of a storage outage),
  every shard is back at its copies, or restored from the checkpoint and copied again: the
  controller sees it healthy, and on the nodes the routing's primary is the primary of the
  shard's generation and forwards to the routing's backups, each alive and holding the shard
  at least as far as the primary believes it does.
  Messages are still dropped and duplicated meanwhile. The bound is the sum of what a repair
  may wait for, with room for retries: noticing the loss (a worker's removal within 1.5 s,
  heartbeats silent for 2 s, a silent worker retired after 4 s), a replacement worker (within
  3 s) and its node, then the fence, promote, restore and copy calls, each retried after a
  failure with a back-off of up to 2 s. ``healed_after`` in the summary is the time it took.

At the end faults stop, the system heals, pushers settle, and it checks that the copies of every
shard converge and hold every acknowledged push once (with ``ack="all"``, less those lost with
all their copies: that mode keeps no pushes to replay).

Each push ``k`` adds 1 at index ``k`` of every shard, so a copy's values say exactly which
pushes it holds and how many times.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..ps.protocol.messages import Beat, ForwardDue, Tick, WriteDue
from ..ps.protocol.node_state import NodeState
from ..ps.protocol.shard import ShardState
from .sim_traffic import Traffic, share_mark
from .sim_world import (
    BEAT_INTERVAL,
    FORWARD_INTERVAL,
    TICK_INTERVAL,
    WRITE_INTERVAL,
    SimulationFailure,
    World,
)

logger = logging.getLogger(__name__)

#: simulated seconds from the end of the last fault to every shard back at its copies
HEAL_BOUND = 30.0
#: the steps after which no fault is injected any more (the rest heals and settles)
FAULT_STEPS = 3000

__all__ = ["SimulationFailure", "simulate"]


def _view(ns: NodeState) -> tuple:
    """What the checks read of a node: the copies it holds (which state, which position), the
    shards it is the primary of with their backups, the generations it knows."""
    return (
        [(s, st, st.position) for s, st in ns.shards.items()],  # a state compares by identity
        [(s, [a for a, _ in b]) for s, b in ns.primaries.items()],
        list(ns.gens.items()),
    )


class _Sim:
    """The world, checked."""

    def __init__(self, world: World):
        self.w = world
        self.t = Traffic(self.w)
        self.healed_since: float | None = 0.0  # since when every shard is back at its copies
        self._bits: dict[tuple[str, int], tuple[ShardState, tuple[int, int], int]] = {}
        self._block_bits: dict[str, tuple[np.ndarray, int]] = {}
        self._views: dict[str, tuple] = {}  # what the checks last read of each node

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> None:
        now = self.w.now
        for node in self.w.nodes.values():
            if node.frozen_until is not None and node.frozen_until <= now:
                node.frozen_until = None
                self.w.log(f"thaw {node.addr}")
        if self.w.next_deadline <= now:
            self.w.next_deadline = float("inf")
            for cid, rec in self.w.calls.items():
                if rec.deadline <= now:
                    self.w.seqno += 1
                    err = TimeoutError("no answer")
                    self.w.msgs.append((now, self.w.seqno, rec.caller, "reply", cid, err))
                    rec.deadline = float("inf")
                self.w.next_deadline = min(self.w.next_deadline, rec.deadline)
        self.t.pusher_guard()
        if self.w.fault_budget > 0 and self.w.rng.random() < 0.01:
            self.w.fault()
        choices = self.w.ready()
        if not choices:
            self.w.advance()
            return
        kind, x = self.w.rng.choice(choices)
        if kind == "msg":
            self.w.msgs.remove(x)
            self.t.deliver(x)
        elif kind == "timer":
            node, timer = x
            self.t.spend(node)
            if timer == "next_forward":
                node.next_forward = self.w.now + FORWARD_INTERVAL
                self.w.node_handle(node, ForwardDue())
            elif timer == "next_write":
                node.next_write = self.w.now + WRITE_INTERVAL
                self.w.node_handle(node, WriteDue())
            else:
                node.next_beat = self.w.now + BEAT_INTERVAL
                beat = Beat(None, node.addr, node.key, self.w.now, node.state.heartbeat())
                self.w.request(node.addr, "ctl", "beat", beat)
        elif kind == "tick":
            self.w.next_tick = self.w.now + TICK_INTERVAL
            self.w.ctl_handle(Tick(self.w.now))
        elif kind == "pusher":
            x.next_act = self.w.now + self.w.rng.choice([0.002, 0.02, 0.1])
            self.t.pusher_act(x)

    # -- invariants ------------------------------------------------------------------------------

    def holders(self, sid: int) -> set[str]:
        ctl = self.w.ctl
        hs = set(ctl.routing.get(sid, ()))
        rnd = ctl.rounds.get(sid)
        if rnd is not None:
            hs |= rnd.waiting | set(rnd.replies)
        for op in ctl.ops.values():
            if op.kind == "promote" and sid in op.sids:
                hs.add(op.addr)
        return {a for a in hs if a in self.w.nodes and a not in self.w.crashed}

    def copy_bits(self, addr: str, sid: int, st: ShardState) -> int:
        """The pushes the copy ``st`` of ``sid`` on ``addr`` holds, a bit each; checks it holds
        none twice. Cached per position: a copy's values change only with its position (every
        apply makes a version, an install or a restore sets the position)."""
        key = (addr, sid)
        cached = self._bits.get(key)
        if cached is not None and cached[0] is st and cached[1] == st.position:
            return cached[2]
        v, ids = st.values, st.ids_since(-1)
        if self.w.holds_twice(v, ids, st.version):
            self.w.fail(f"{addr} holds a push of shard {sid} twice: {v} {ids}")
        bits = self.w.held_pushes(v, ids)
        if self.w.optimizer.is_sum and bits != self.w.held_pushes_by_ids(ids):
            self.w.fail(f"{addr}'s copy of shard {sid}: its values and push ids disagree")
        self._bits[key] = (st, st.position, bits)
        return bits

    def block_bits(self, path: str) -> int:
        values, _, _, ids, _, _ = self.w.blocks[path]
        cached = self._block_bits.get(path)
        if cached is None or cached[0] is not values:
            cached = (values, self.w.held_pushes(values, ids))
            self._block_bits[path] = cached
        return cached[1]

    def healed(self) -> bool:
        """Every shard back at its copies: the controller sees it healthy, and it is true: the
        primary the routing names is alive (the incarnation the controller knows), is the
        primary of the shard at the shard's generation and forwards to the backups the routing
        names, each alive and holding the shard."""
        ctl = self.w.ctl
        if not ctl.healthy():
            return False
        for sid, holders in ctl.routing.items():
            for a in holders:
                node = self.w.nodes.get(a)
                if node is None or a in self.w.crashed or node.key != ctl.nodes.get(a):
                    return False
                if sid not in node.state.shards:
                    return False
            ns = self.w.nodes[holders[0]].state
            if ns.gens.get(sid) != ctl.gens[sid] or sid not in ns.primaries:
                return False
            if {a for a, _ in ns.primaries[sid]} != set(holders[1:]):
                return False
            for b in holders[1:]:  # what the primary believes a backup holds, it holds
                if (
                    ns.acked.get(b, {}).get(sid, (-1, -1))
                    > self.w.nodes[b].state.shards[sid].position
                ):
                    return False
        return True

    def check_healing(self, changed: bool) -> None:
        """The healing bound: no longer than HEAL_BOUND after the end of the last fault (so
        far) without every shard back at its copies."""
        if changed:
            if not self.healed():
                self.healed_since = None
            elif self.healed_since is None:
                self.healed_since = self.w.now
        if self.healed_since is None and self.w.now > self.w.faults_end + HEAL_BOUND:
            self.w.fail(
                f"not healed {HEAL_BOUND:g}s after the last fault (it ended at "
                f"{self.w.faults_end:.2f}): {self.status()}"
            )

    def check(self) -> None:
        dirty, self.w.dirty = self.w.dirty, set()
        changed = self.w.changed
        for addr in dirty:
            if addr in self.w.crashed:
                continue
            ns = self.w.nodes[addr].state
            for sid, st in ns.shards.items():
                self.copy_bits(addr, sid, st)
            view = _view(ns)
            if self._views.get(addr) != view:
                self._views[addr] = view
                changed = True
        self.check_manifest()
        self.check_healing(changed)
        if not changed:
            return
        self.w.changed = False
        blocks = self.w.manifests[-1]["blocks"]
        for sid in range(self.w.n_shards):
            # acknowledged, not gone with every copy (a restore accounts for those), not in
            # the checkpoint's block: some pusher or some copy must hold it
            ok = self.w.acked_bits[sid] & ~self.w.lost_bits[sid] & ~self.block_bits(blocks[sid])
            if not ok:
                continue
            holders = self.holders(sid)
            if not holders:
                continue  # every copy lost: the restore accounts for what goes
            for a in holders:
                held = self.w.nodes[a].state.shards.get(sid)
                if held is not None:
                    ok &= ~self.copy_bits(a, sid, held)
            if ok:
                for p in self.w.pushers:
                    for h in p.log.held(sid):
                        ok &= ~(1 << h.push_id)
            if ok:
                k = (ok & -ok).bit_length() - 1
                self.w.fail(f"acknowledged push {k} of shard {sid} is lost (holders {holders})")

    def check_manifest(self) -> None:
        if len(self.w.manifests) == self.w.checked_manifests:
            return
        self.w.checked_manifests = len(self.w.manifests)
        m = self.w.manifests[-1]
        if len(self.w.manifests) > 1:
            prev = self.w.manifests[-2]
            if m["sequence"] <= prev["sequence"]:
                self.w.fail(f"manifest sequence went from {prev['sequence']} to {m['sequence']}")
            for s in range(self.w.n_shards):
                a = (prev["generations"][s], prev["versions"][s])
                b = (m["generations"][s], m["versions"][s])
                if b < a:
                    self.w.fail(f"manifest went back for shard {s}: {a} -> {b}")
        for s, path in enumerate(m["blocks"]):
            if path not in self.w.blocks:
                self.w.fail(f"the manifest names {path}, which is not there")
            if self.w.blocks[path][1] != m["versions"][s]:
                self.w.fail(f"the manifest names {path} at another version")

    def settled(self) -> bool:
        if self.w.pushes_started < self.w.total_pushes or any(
            p.delivery or p.retry or p.calls or p.log for p in self.w.pushers
        ):
            return False
        if self.healed_since is None or self.w.ctl.ops:
            return False
        m = self.w.manifests[-1]
        for sid, holders in self.w.ctl.routing.items():
            copies = [self.w.nodes[a].state.shards.get(sid) for a in holders]
            states = [st for st in copies if st is not None]
            if len(states) != len(copies):
                return False
            if len({st.position for st in states}) != 1:
                return False
            if m["versions"][sid] != states[0].version:
                return False
        return True

    def status(self) -> str:
        positions = {
            sid: {a: getattr(self.w.nodes[a].state.shards.get(sid), "position", None) for a in h}
            for sid, h in self.w.ctl.routing.items()
        }
        pushers = {
            p.name: (
                None if p.delivery is None else (p.delivery.request.op, p.delivery.request.push_id),
                len(p.calls),
                len(p.log),
            )
            for p in self.w.pushers
        }
        return (
            f"healthy={self.w.ctl.healthy()} ops={list(self.w.ctl.ops.values())} "
            f"positions={positions} manifest={self.w.manifests[-1]['versions']} "
            f"pushers={pushers} started={self.w.pushes_started}/{self.w.total_pushes}"
        )

    def final_check(self) -> None:
        self.acked_lost = 0  # acknowledged pushes gone with every copy (accounted by a restore)
        for sid, holders in self.w.ctl.routing.items():
            states = [self.w.nodes[a].state.shards[sid] for a in holders]
            for st in states[1:]:
                if not np.array_equal(st.values, states[0].values):
                    self.w.fail(f"copies of shard {sid} differ at the end")
                mine, first = st.state, states[0].state
                if (mine is None) != (first is None) or (
                    mine is not None and first is not None and not np.array_equal(mine, first)
                ):
                    self.w.fail(f"copies of shard {sid} differ in the optimizer's state")
            if not self.w.optimizer.is_sum:
                self.final_replay(sid, states[0])
                continue
            values = states[0].values
            for k, shards in self.w.acked.items():
                if sid in shards and values[k] != 1:
                    if not self.may_be_lost(sid, k):
                        self.w.fail(f"acknowledged push {k} of shard {sid} missing at the end")
                    self.acked_lost += 1

    def may_be_lost(self, sid: int, k: int) -> bool:
        """Whether acknowledged push ``k`` may be missing from shard ``sid`` at the end: only
        when every copy of the shard was lost and its restore from the checkpoint accounts for
        it; and with ``ack="replay"`` only when its pusher let go of it over its byte budget
        (every copy held it then): a replaying pusher keeps every other push until the
        checkpoint holds it too, so not even the loss of every copy may take one."""
        if k not in self.w.lost_ok.get(sid, ()):
            return False
        return self.w.ack != "replay" or k in self.t.shed_pushes.get(sid, ())

    def final_replay(self, sid: int, st: ShardState) -> None:
        """With an optimizer whose updates do not commute: the shard holds each acknowledged
        push once, and its values (and state) are those of a replay of the pushes it applied,
        in the order its primary's lineage applied them, through the same optimizer."""
        order = [p for _, p in st.ids_since(-1)]
        if [v for v, _ in st.ids_since(-1)] != list(range(1, st.version + 1)):
            self.w.fail(f"shard {sid}: versions {st.ids_since(-1)} are not one per push")
        for k, shards in self.w.acked.items():
            if sid in shards and k not in order:
                if not self.may_be_lost(sid, k):
                    self.w.fail(f"acknowledged push {k} of shard {sid} missing at the end")
                self.acked_lost += 1
        n = st.size
        # a fresh shard through the same optimizer, each push with its mark (with rounds, which
        # push opens a synchronous step's round depends on the marks held before it)
        replay = ShardState(sid, 0, n, dedup_window=n + 1, optimizer=self.w.optimizer)
        for k in order:
            d = np.zeros(n, np.float32)
            d[k] = 1
            replay.apply(d, k, share_mark(k, self.w.rounds))
        values, state = replay.values, replay.state
        if not np.array_equal(values, st.values) or (
            state is not None and (st.state is None or not np.array_equal(state, st.state))
        ):
            self.w.fail(f"shard {sid}: its values are not a replay of its pushes in order")


def simulate(
    seed: int,
    *,
    faults: bool = True,
    ack: str | None = None,
    steps: int = 20000,
    trace: bool = False,
    optimizer: Any = None,
    rounds: int = 0,
    replay_bytes: int | None = None,
) -> dict:
    """Run the simulation of ``seed`` (see the module doc); returns a summary. Raises
    :class:`SimulationFailure` with the seed and the trace when an invariant breaks; with
    ``trace``, prints the trace as it goes (to replay a failing seed). ``ack`` forces the
    pushers' acknowledgement mode (drawn from the seed by default). Faults stop after
    ``FAULT_STEPS`` steps at the latest; ``steps`` caps the run (a system that healed but
    whose pushers never settle fails then). ``replay_bytes``: the pushers' byte budget
    (``adam.ps.replay-bytes``; drawn apart from the seed's stream by default: in a quarter of
    the seeds a few pushes, so that pushes make room)."""
    quiet = logging.getLogger("adam_dask.ps")
    level = quiet.level
    if not trace:
        quiet.setLevel(logging.CRITICAL)
    try:
        sim = _Sim(World(seed, faults, ack, optimizer, rounds, replay_bytes))
        for i in range(steps):
            sim.step()
            sim.check()
            if trace and sim.w.trace:
                print("\n".join(sim.w.trace))
                sim.w.trace.clear()
            elif len(sim.w.trace) > 4000:
                del sim.w.trace[:-400]  # a failure shows the last 400
            if i > FAULT_STEPS and sim.w.fault_budget > 0:
                sim.w.fault_budget = 0
            if sim.w.fault_budget == 0 and sim.settled():
                break
        else:
            sim.w.fail(f"the system did not settle in {steps} steps: {sim.status()}")
        sim.final_check()
        return {
            "seed": seed,
            "nodes": sim.w.n_nodes,
            "shards": sim.w.n_shards,
            "pushes": len(sim.w.acked),
            "ack": sim.w.ack,
            "optimizer": sim.w.optimizer.name,
            "rounds": sim.w.rounds,
            "lost_with_all_copies": sum(len(v) for v in sim.w.lost_ok.values()),
            "acknowledged_lost": sim.acked_lost,
            "restored": len(sim.w.ctl.restored),
            "replay_bytes": sim.w.budget,
            "made_room": sim.t.room_made,
            "shed": sum(len(v) for v in sim.t.shed_pushes.values()),
            "healed_after": max(0.0, (sim.healed_since or 0.0) - sim.w.faults_end),
            "seconds": sim.w.now,
        }
    finally:
        quiet.setLevel(level)
