"""The deterministic simulation of the PS protocol (adam_dask.testing.simulation): seeds of
delayed, reordered, dropped and duplicated messages, killed and frozen nodes, storage outages,
checked after every step, and healed within the bound after the last fault. ``ADAM_SIM_SEEDS=N``
runs N seeds instead of the default 1000 (benchmarks/simulation.py sweeps 100,000); a failing
seed replays exactly with ``simulate(seed, trace=True)``, which prints its trace. The schedules
whose situations once stalled are named tests in test_simulation_seeds.py."""

from __future__ import annotations

import os

import pytest

from adam_dask.testing.simulation import HEAL_BOUND, SimulationFailure, simulate

SEEDS = int(os.environ.get("ADAM_SIM_SEEDS", "1000"))
CHUNKS = 10
NESTEROV = {"kind": "nesterov", "lr": 0.7, "momentum": 0.9, "staleness": False}


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_protocol_holds_under_faults(chunk):
    runs = [simulate(seed) for seed in range(chunk, SEEDS, CHUNKS)]
    assert all(r["pushes"] > 0 for r in runs)
    assert all(r["healed_after"] <= HEAL_BOUND for r in runs)


def test_the_healing_bound_is_checked(monkeypatch):
    """With a bound shorter than a repair takes, the seeds whose faults needed one fail on
    it (else the bound would be checked by nothing)."""
    from adam_dask.testing import simulation

    monkeypatch.setattr(simulation, "HEAL_BOUND", 0.3)
    failed = []
    for seed in range(20):
        try:
            simulate(seed)
        except SimulationFailure as exc:
            failed.append(str(exc).splitlines()[0])
    assert failed
    assert all("not healed 0.3s after the last fault" in f for f in failed)


def test_without_faults_nothing_is_lost_or_restored():
    for seed in range(20):
        r = simulate(seed, faults=False)
        assert r["lost_with_all_copies"] == 0 and r["restored"] == 0


def test_a_seed_replays_exactly():
    assert simulate(7) == simulate(7)


def test_the_simulation_exercises_total_loss_and_restore():
    runs = [simulate(seed) for seed in range(40)]
    assert any(r["restored"] for r in runs)
    assert {r["ack"] for r in runs} == {"replay", "all"}
    # every copy of a shard lost after pushes were acknowledged, and none of them missing at
    # the end: the pushers held them until the checkpoint did, and replayed them to the
    # restored shard (before pushes were kept past "every copy holds it", 5 of these 40 seeds
    # lost acknowledged pushes, 31 in all)
    replay = [r for r in runs if r["ack"] == "replay" and r["restored"]]
    assert sum(r["lost_with_all_copies"] for r in replay) > 0
    assert all(r["acknowledged_lost"] == 0 for r in replay)


def test_the_checks_catch_a_lossy_protocol():
    """ack="primary" acknowledges before the backups hold a push: the simulation must find
    acknowledged pushes lost when primaries die (else its checks prove nothing)."""
    found = []
    for seed in range(40):
        try:
            simulate(seed, ack="primary")
        except SimulationFailure as exc:
            found.append(str(exc))
    assert found
    assert all("is lost" in f or "missing at the end" in f for f in found)


@pytest.mark.parametrize("chunk", range(2))
def test_protocol_holds_with_server_momentum(chunk):
    """The same faults with the Nesterov server optimizer, whose updates do not commute: the
    copies agree on values and momentum, each acknowledged push is applied once, and each
    shard ends at a replay of its pushes in its primary's order (``final_replay``)."""
    seeds = range(chunk, SEEDS // 4, 2)
    runs = [simulate(seed, optimizer=NESTEROV) for seed in seeds]
    assert {r["optimizer"] for r in runs} == {"nesterov"}
    assert any(r["restored"] for r in runs)
    # a replaying pusher loses nothing it kept; what it let go of over its byte budget (every
    # copy held it) may go with every copy of its shard (test_pushers_make_room_...)
    assert all(r["acknowledged_lost"] == 0 for r in runs if r["ack"] == "replay" and not r["shed"])


def test_pushers_make_room_in_a_small_byte_budget():
    """With the least budget there is (two pushes of the model), the pushers run the courier's
    plan for room before their pushes: what every copy holds is let go of while the checkpoint
    is behind, the primaries are asked urgently, and pushes past half the budget ask them to
    forward at once. Every invariant holds; an acknowledged push missing at the end is one its
    pusher let go of, lost with every copy of its shard (the simulation checks each one)."""
    runs = [simulate(seed, ack="replay", replay_bytes=0) for seed in range(40)]
    assert all(r["replay_bytes"] == 2 * 4 * r["shards"] * r["pushes"] for r in runs)
    assert sum(r["made_room"] > 0 for r in runs) >= 30
    assert sum(r["shed"] > 0 for r in runs) >= 10
    assert all(r["acknowledged_lost"] <= r["shed"] for r in runs)
    # by default a quarter of the seeds draw a budget of a few pushes, and some make room
    drawn = [simulate(seed, faults=False) for seed in range(40)]
    assert 0 < sum(r["made_room"] > 0 for r in drawn) < 20


def test_the_checks_catch_a_pusher_that_lets_go_of_what_a_copy_lacks(monkeypatch):
    """A byte budget that let go of pushes some copy still lacks would lose acknowledged
    pushes with their primary: the simulation must find it."""
    from adam_dask.ps.protocol.replay import ReplayLog

    def shed_all(self, below, primaries=None):
        gone = 0
        for per in self._held.values():
            for p in list(per):
                if self.nbytes <= below:
                    return gone
                self.nbytes -= per.pop(p).drop()
                gone += 1
        return gone

    monkeypatch.setattr(ReplayLog, "_shed", shed_all)
    found = []
    for seed in range(40):
        try:
            simulate(seed, ack="replay", replay_bytes=0)
        except SimulationFailure as exc:
            found.append(str(exc).splitlines()[0])
    assert found
    assert all("is lost" in f or "missing at the end" in f for f in found), found


def test_synchronous_rounds_survive_the_same_faults():
    """Pushes marked as shares of synchronous steps (3 replicas a round) under the same fault
    schedules: each shard ends a replay of its pushes in its lineage's order, each push opening
    or joining its round as the marks held before it say: the marks went with every copy and
    checkpoint block, as the values and the momentum did."""
    runs = [simulate(seed, optimizer=NESTEROV, rounds=3) for seed in range(40)]
    assert {r["rounds"] for r in runs} == {3}
    assert sum(r["restored"] for r in runs) > 0  # some shards came back from storage


def test_the_replay_check_catches_marks_not_copied(monkeypatch):
    """A copy that takes the values and the momentum but not the marks opens a second round
    after a promotion or a restore mid-round: the replay check must find it."""
    from adam_dask.ps.protocol.shard import ShardState

    monkeypatch.setattr(ShardState, "set_marks", lambda self, marks: None)
    found = []
    for seed in range(40):
        try:
            simulate(seed, optimizer=NESTEROV, rounds=3)
        except SimulationFailure as exc:
            found.append(str(exc).splitlines()[0])
    assert found
    assert all("replay of its pushes" in f for f in found), found


def test_the_replay_check_catches_momentum_not_copied(monkeypatch):
    """A backup that takes the primary's values but not its momentum continues from another
    state after a promotion: the checks must find it."""
    from adam_dask.ps.protocol.shard import ShardState

    monkeypatch.setattr(ShardState, "set_state", lambda self, state: None)
    found = []
    for seed in range(20):
        try:
            simulate(seed, optimizer=NESTEROV)
        except SimulationFailure as exc:
            found.append(str(exc).splitlines()[0])
    assert found
    assert all("optimizer's state" in f or "replay of its pushes" in f for f in found), found
