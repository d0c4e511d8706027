"""A deterministic simulation of the parameter-server protocol, on the pure state machines.

:func:`simulate` runs, from one seed, a few PS nodes (:class:`~adam_dask.ps._node_state.NodeState`),
the controller (:class:`~adam_dask.ps._controller.ServerState`) and several pushers over a
simulated network and clock: messages are delayed, reordered, dropped and duplicated; nodes are
killed (their worker comes back under a new address, empty), frozen (sockets open, nothing
answers; after a while they wake and act on what they knew) and storage has outages. Every
choice comes from ``random.Random(seed)``, so a seed replays exactly.

After every step it checks:

* **at most once**: no copy of a shard, and no checkpoint block, holds any push twice;
* **nothing acknowledged lost**: every push a pusher was told is applied is held by a live copy
  the controller routes to, by the pusher itself (not yet durable), or by the checkpoint;
  it may be missing for a while only when every copy of its shard is lost, and then only if
  the shard's restore from the checkpoint accounts for it; with ``ack="replay"`` the pusher
  replays it to the restored shard, so at the end it is there;
* **the manifest never goes back**: sequence numbers and each shard's ``(generation, version)``
  only grow, and every block the newest manifest names exists.

At the end faults stop, the system heals, pushers settle, and it checks that the copies of every
shard converge and hold every acknowledged push once (with ``ack="all"``, less those lost with
all their copies: that mode keeps no pushes to replay).

Each push ``k`` adds 1 at index ``k`` of every shard, so a copy's values say exactly which
pushes it holds and how many times.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import numpy as np

from ._sim_world import World

logger = logging.getLogger(__name__)

__all__ = ["SimulationFailure", "simulate"]


class SimulationFailure(AssertionError):
    """An invariant broke; the message names the seed and ends with the trace."""


class _Sim(World):
    """The world, checked."""

    # -- invariants ------------------------------------------------------------------------------

    def fail(self, what: str) -> NoReturn:
        tail = "\n".join(self.trace[-400:])
        raise SimulationFailure(
            f"seed {self.seed}: {what}\n(replay: adam_dask.ps.simulation.simulate({self.seed}, "
            f"trace=True))\n--- trace (last 400 steps) ---\n{tail}"
        )

    def holders(self, sid: int) -> set[str]:
        hs = set(self.ctl.routing.get(sid, ()))
        rnd = self.ctl.rounds.get(sid)
        if rnd is not None:
            hs |= rnd.waiting | set(rnd.replies)
        for op in self.ctl.ops.values():
            if sid in op.sids and op.kind == "promote":
                hs.add(op.addr)
        return {a for a in hs if self.alive(a)}

    def check(self) -> None:
        dirty, self.dirty = self.dirty, set()
        for addr in dirty:
            if addr in self.crashed:
                continue
            for sid, st in self.nodes[addr].state.shards.items():
                if st.values.max(initial=0) > 1 or st.values.min(initial=0) < 0:
                    self.fail(f"{addr} holds a push of shard {sid} twice: {st.values}")
        self.check_manifest()
        if not dirty and not self.changed:
            return
        self.changed = False
        m = self.manifests[-1]
        n = self.total_pushes
        for sid in range(self.n_shards):
            holders = self.holders(sid)
            if not holders:
                continue  # every copy lost: the restore accounts for what goes
            ok = self.acked_mask[sid] & ~self.lost_mask[sid]
            ok &= self.blocks[m["blocks"][sid]][0] != 1
            if not ok.any():
                continue
            for h in self._held(sid):
                ok[h.push_id] = False
            for a in holders:
                held = self.nodes[a].state.shards.get(sid)
                if held is not None:
                    ok &= held.values[:n] != 1
            if ok.any():
                k = int(np.flatnonzero(ok)[0])
                self.fail(f"acknowledged push {k} of shard {sid} is lost (holders {holders})")

    def check_manifest(self) -> None:
        if len(self.manifests) == self.checked_manifests:
            return
        self.checked_manifests = len(self.manifests)
        m = self.manifests[-1]
        if len(self.manifests) > 1:
            prev = self.manifests[-2]
            if m["sequence"] <= prev["sequence"]:
                self.fail(f"manifest sequence went from {prev['sequence']} to {m['sequence']}")
            for s in range(self.n_shards):
                a = (prev["generations"][s], prev["versions"][s])
                b = (m["generations"][s], m["versions"][s])
                if b < a:
                    self.fail(f"manifest went back for shard {s}: {a} -> {b}")
        for s, path in enumerate(m["blocks"]):
            if path not in self.blocks:
                self.fail(f"the manifest names {path}, which is not there")
            if self.blocks[path][1] != m["versions"][s]:
                self.fail(f"the manifest names {path} at another version")

    def settled(self) -> bool:
        if self.pushes_started < self.total_pushes or any(
            p.current or p.calls or p.log for p in self.pushers
        ):
            return False
        if not self.ctl.healthy() or self.ctl.ops:
            return False
        m = self.manifests[-1]
        for sid, holders in self.ctl.routing.items():
            copies = [self.nodes[a].state.shards.get(sid) for a in holders]
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
            sid: {a: getattr(self.nodes[a].state.shards.get(sid), "position", None) for a in h}
            for sid, h in self.ctl.routing.items()
        }
        pushers = {p.name: (p.current, len(p.calls), len(p.log)) for p in self.pushers}
        return (
            f"healthy={self.ctl.healthy()} ops={list(self.ctl.ops.values())} "
            f"positions={positions} manifest={self.manifests[-1]['versions']} "
            f"pushers={pushers} started={self.pushes_started}/{self.total_pushes}"
        )

    def final_check(self) -> None:
        self.acked_lost = 0  # acknowledged pushes gone with every copy (accounted by a restore)
        for sid, holders in self.ctl.routing.items():
            states = [self.nodes[a].state.shards[sid] for a in holders]
            for st in states[1:]:
                if not np.array_equal(st.values, states[0].values):
                    self.fail(f"copies of shard {sid} differ at the end")
            values = states[0].values
            for k, shards in self.acked.items():
                if sid in shards and values[k] != 1:
                    # a replaying pusher keeps each push until the checkpoint holds it too, so
                    # not even the loss of every copy may take one
                    if self.ack == "replay" or k not in self.lost_ok.get(sid, ()):
                        self.fail(f"acknowledged push {k} of shard {sid} missing at the end")
                    self.acked_lost += 1


def simulate(
    seed: int,
    *,
    faults: bool = True,
    ack: str | None = None,
    steps: int = 6000,
    trace: bool = False,
) -> dict:
    """Run the simulation of ``seed`` (see the module doc); returns a summary. Raises
    :class:`SimulationFailure` with the seed and the trace when an invariant breaks; with
    ``trace``, prints the trace as it goes (to replay a failing seed). ``ack`` forces the
    pushers' acknowledgement mode (drawn from the seed by default)."""
    quiet = logging.getLogger("adam_dask.ps")
    level = quiet.level
    if not trace:
        quiet.setLevel(logging.CRITICAL)
    try:
        sim = _Sim(seed, faults, ack)
        for i in range(steps):
            sim.step()
            sim.check()
            if trace and sim.trace:
                print("\n".join(sim.trace))
                sim.trace.clear()
            if i > steps // 2 and sim.fault_budget > 0:
                sim.fault_budget = 0
            if sim.fault_budget == 0 and sim.settled():
                break
        else:
            sim.fail(f"the system did not settle in {steps} steps: {sim.status()}")
        sim.final_check()
        return {
            "seed": seed,
            "nodes": sim.n_nodes,
            "shards": sim.n_shards,
            "pushes": len(sim.acked),
            "ack": sim.ack,
            "lost_with_all_copies": sum(len(v) for v in sim.lost_ok.values()),
            "acknowledged_lost": sim.acked_lost,
            "restored": len(sim.ctl.restored),
            "seconds": sim.now,
        }
    finally:
        quiet.setLevel(level)
