"""The PS node's protocol as a pure state machine (no Dask): apply, forward, acknowledge,
fence, write back."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.ps.protocol.messages import (
    Assign,
    Confirmed,
    Fence,
    Flush,
    Forward,
    ForwardDone,
    ForwardDue,
    HeartbeatReply,
    Push,
    Pushes,
    Replicate,
    Reply,
    Restore,
    Tick,
    WriteBlocks,
    WriteDone,
    WriteDue,
)
from adam_dask.ps.protocol.node_machine import handle
from adam_dask.ps.protocol.node_state import NodeState
from adam_dask.ps.protocol.replies import ReplicateReply

N = 8


def replies(actions):
    return {a.req: a.value for a in actions if isinstance(a, Reply)}


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


@pytest.fixture
def primary():
    """Node "p": primary of shard 0 (generation 3) with backups "b1" and "b2"."""
    ns = NodeState("p", dedup_window=64, checkpoint=True)
    handle(ns, Assign("a", {0: (0, N)}, {0: 3}, {0: [("b1", "k1"), ("b2", "k2")]}))
    return ns


@pytest.fixture
def backup():
    ns = NodeState("b1", dedup_window=64)
    handle(ns, Assign("a", {0: (0, N)}, {0: 3}))
    return ns


def push(req, value, pid, gen=3, ack="replay"):
    return Push(req, {0: np.full(N, value, np.float32)}, pid, {0: gen}, ack)


def test_push_applies_once_and_reports_what_every_copy_holds(primary):
    out = handle(primary, Pushes((push("x", 1, 11), push("y", 2, 12), push("x2", 1, 11))))
    r = replies(out)
    assert r["x"].per_shard == {0: 1} and r["y"].per_shard == {0: 2}
    assert r["x2"].per_shard == {0: 1}  # the same push id again: applied once
    assert r["y"].confirmed == {0: -1}  # the backups hold nothing yet
    np.testing.assert_array_equal(primary.shards[0].values, np.full(N, 3))


def test_a_stale_stamp_is_refused_as_moved(primary):
    r = replies(handle(primary, Pushes((push("x", 1, 1, gen=2),))))
    assert r["x"].moved == (0,) and r["x"].per_shard == {}
    assert primary.refused_stale == 1 and primary.shards[0].version == 0


def test_forward_then_confirmed_and_ack_all_waits_for_it(primary, backup):
    out = handle(primary, Pushes((push("all", 1, 7, ack="all"),)))
    assert "all" not in replies(out)  # waits for the backups
    fwd = {f.addr: f for f in of(out, Forward)}
    assert set(fwd) == {"b1", "b2"}
    got = replies(handle(backup, Replicate("r", "p", fwd["b1"].snaps)))["r"]
    assert got.held == {0: (3, 1)} and backup.shards[0].values[0] == 1
    assert not replies(handle(primary, ForwardDone("b1", got.held, {})))
    r = replies(handle(primary, ForwardDone("b2", {0: (3, 1)}, {})))
    assert r["all"].confirmed == {0: 1}
    assert primary.confirmed(0) == 1
    assert not of(handle(primary, ForwardDue()), Forward)  # nothing new to send


def test_fenced_backup_refuses_the_old_primary_which_steps_down(primary, backup):
    handle(primary, Pushes((push("x", 1, 1),)))
    snaps = next(f for f in of(handle(primary, ForwardDue()), Forward) if f.addr == "b1").snaps
    assert replies(handle(backup, Fence("f", {0: 4})))["f"] == {0: (3, 0)}
    got = replies(handle(backup, Replicate("r", "p", snaps)))["r"]
    assert got == ReplicateReply({}, {0: 4})  # generation 3 is over
    assert backup.refused_stale == 1 and backup.shards[0].version == 0
    handle(primary, ForwardDone("b1", got.held, got.refused))
    assert 0 not in primary.primaries  # no longer applies, forwards or writes shard 0
    r = replies(handle(primary, Pushes((push("y", 1, 2),))))
    assert r["y"].moved == (0,)
    assert not of(handle(primary, WriteDue()), WriteBlocks)


def test_a_node_the_controller_dropped_stops_serving(primary):
    handle(primary, HeartbeatReply(False, {}))
    assert not primary.member
    assert replies(handle(primary, Pushes((push("x", 1, 1),))))["x"].moved == (0,)


def test_write_back_refused_as_stale_steps_down_accepted_is_flushed(primary):
    handle(primary, Pushes((push("x", 1, 1),)))
    (write,) = of(handle(primary, WriteDue()), WriteBlocks)
    assert [(s.shard, s.gen, s.version) for s in write.snaps] == [(0, 3, 1)]
    out = handle(primary, Flush("f", None, True))  # waits for the copies and the manifest
    for b in ("b1", "b2"):
        out += handle(primary, ForwardDone(b, {0: (3, 1)}, {}))
    assert "f" not in replies(out)
    assert replies(handle(primary, WriteDone({0: 1}, {})))["f"].per_shard == {0: 1}
    handle(primary, Pushes((push("y", 1, 2),)))
    handle(primary, WriteDue())
    handle(primary, WriteDone({}, {0: 5}))  # the controller knows generation 5
    assert 0 not in primary.primaries


def test_a_flush_of_the_copies_alone_answers_without_the_checkpoint_and_says_what_is_durable(
    primary,
):
    handle(primary, Pushes((push("x", 1, 1),)))
    out = handle(primary, Flush("f", None, False))  # an epoch's end: storage plays no part
    for b in ("b1", "b2"):
        out += handle(primary, ForwardDone(b, {0: (3, 1)}, {}))
    r = replies(out)["f"]
    assert r.per_shard == {0: 1} and r.durable[0] < 1  # the pusher keeps its push
    stuck = handle(primary, Flush("g", None, True))  # waits for the write-back too
    assert "g" not in replies(stuck)
    assert primary.abandon_flush("g") == "checkpoint"  # storage is what is missing
    assert primary.abandon_flush("g") is None  # forgotten
    handle(primary, Pushes((push("y", 1, 2),)))
    handle(primary, Flush("h", None, False))
    assert primary.abandon_flush("h") == "copies"  # a backup lacks version 2


def test_restore_installs_the_block_with_its_push_ids_once():
    ns = NodeState("n", dedup_window=64)
    values = np.full(N, 4, np.float32)
    r = replies(handle(ns, Restore("r", 0, 9, 0, N, 4, values, ((4, 99),))))
    assert r["r"] == 4 and ns.shards[0].position == (9, 4)
    handle(ns, Pushes((push("x", 1, 99, gen=9),)))  # a pusher replays a push the block holds
    assert ns.shards[0].version == 4
    handle(ns, Pushes((push("y", 1, 100, gen=9),)))
    again = replies(handle(ns, Restore("r2", 0, 9, 0, N, 4, values, ())))
    assert again["r2"] == 4 and ns.shards[0].version == 5  # the same restore twice: no reset


def test_the_story_keeps_commands_and_step_downs_not_every_push(primary, backup):
    for i in range(5):
        handle(primary, Pushes((push(f"x{i}", 1, 100 + i),)))
    assert [e.event.split("(")[0] for e in primary.story(0)] == ["Assign"]  # pushes: not noted
    snaps = next(f for f in of(handle(primary, ForwardDue()), Forward) if f.addr == "b1").snaps
    handle(backup, Fence("f", {0: 4}, stimulus_id="ctl-WorkerRemoved-7"))
    got = replies(handle(backup, Replicate("r", "p", snaps)))["r"]
    handle(primary, ForwardDone("b1", got.held, got.refused))  # fenced: steps down
    story = primary.story(0)
    assert story[-1].event.startswith("ForwardDone(") and story[-1].shards == (0,)
    fence = backup.story(0)[-1]
    assert fence.stimulus == "ctl-WorkerRemoved-7" and fence.event.startswith("Fence(")
    assert fence.actions == ("Reply",)
    assert primary.stats()["story"][-1]["event"].startswith("ForwardDone(")


def test_validate_finds_a_broken_invariant(primary):
    primary.validate()
    primary.shards[0].gen = 9  # a copy ahead of the node's fence: nothing may do this
    with pytest.raises(AssertionError, match="past the fence"):
        primary.validate()


def test_every_event_has_a_handler_and_an_unknown_one_is_refused(primary):
    with pytest.raises(TypeError, match="does not handle Tick"):
        handle(primary, Tick(1.0))


def test_a_forward_whose_push_ids_start_past_the_copy_is_refused_then_sent_whole(primary):
    """The primary believes backup b1 holds version 2 (a stale record); b1 holds nothing yet:
    it refuses the forward naming ids after 2 only, and the primary's next forward to it is
    a whole copy, every id with it."""
    handle(primary, Pushes(tuple(push(f"r{i}", 1, 20 + i) for i in range(3))))
    primary.acked["b1"] = {0: (3, 2)}  # stale: an answer of the node b1's worker hosted before
    (fwd,) = [f for f in of(handle(primary, ForwardDue()), Forward) if f.addr == "b1"]
    (snap,) = fwd.snaps
    assert not snap.full and snap.base == 2 and [p for _, p in snap.ids] == [22]
    fresh = NodeState("b1", dedup_window=64)
    handle(fresh, Assign("a", {0: (0, N)}, {0: 3}, {}, -1))
    (answer,) = replies(handle(fresh, Replicate("f", "p", fwd.snaps))).values()
    assert answer.refused == {0: -3} and fresh.shards[0].version == -1
    handle(primary, ForwardDone("b1", answer.held, answer.refused))
    (again,) = [f for f in of(handle(primary, ForwardDue()), Forward) if f.addr == "b1"]
    assert again.snaps[0].full and [p for _, p in again.snaps[0].ids] == [20, 21, 22]
    (answer,) = replies(handle(fresh, Replicate("g", "p", again.snaps))).values()
    assert answer.held == {0: (3, 3)} and fresh.shards[0].ids() == {20: 1, 21: 2, 22: 3}


def test_actions_carry_their_events_stimulus_and_handle_validates_when_asked(primary):
    forwards = of(handle(primary, Pushes((push("x", 1, 100),), stimulus_id="push-100")), Forward)
    forwards += of(handle(primary, ForwardDue(stimulus_id="forward-due-1")), Forward)
    assert forwards and {f.stimulus_id for f in forwards} <= {"push-100", "forward-due-1"}
    made_up = handle(primary, Confirmed("c", (0,)))  # no cause given: the machine names one
    assert made_up and all(a.stimulus_id.startswith("node-") for a in made_up), made_up
    primary.shards[0].gen = 9  # broken: only a validating handle says so
    handle(primary, ForwardDue())
    with pytest.raises(AssertionError, match="past the fence"):
        handle(primary, ForwardDue(), validate=True)
