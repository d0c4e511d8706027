"""The courier's plan (adam_dask.ps.protocol.courier_plan), pure: what a pusher does with the
pushes it holds, step by step, with the time passed in (no Dask, no threads, no sleeps)."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.errors import ShardUnavailable
from adam_dask.ps.protocol.courier_plan import (
    Ask,
    CourierPlan,
    Deliver,
    Done,
    GiveUp,
    Refresh,
    Replay,
    Shed,
    Wait,
    replay_budget,
)
from adam_dask.ps.protocol.replay import HeldPush, ReplayLog
from adam_dask.ps.protocol.request import Request
from adam_dask.ps.protocol.routing import Routing

SHARDS = [(0, 4), (4, 8)]  # two shards of 4 floats: a push of both holds 2 x 16 bytes
PART = 16
TIMEOUT = 60.0  # adam.ps.failover-timeout
INTERVAL = 2.0  # adam.ps.forward-interval


def routing(primaries: list[str], gens: list[int] | None = None) -> Routing:
    r = Routing("s")
    r.set(
        {
            "routing": [[p, "x", "y"] for p in primaries],
            "gens": gens or [0] * len(primaries),
            "nodes": {},
            "pending": [],
            "lost": [],
            "generation": 0,
            "healthy": True,
        }
    )
    return r


def held(log: ReplayLog, pid: int, sid: int, version: int, primary: str = "a") -> None:
    log.add(sid, HeldPush(pid, "push", np.ones(4, np.float32), primary, 0, version, PART))


def a_push(pid: int = 99) -> Request:
    return Request("push", (0, 1), pid, "replay", values=np.zeros(8, np.float32))


def walk(
    plan,
    now: float = 0.0,
    answer=None,
    log: ReplayLog | None = None,
    limit: int = 50,
    refresh=None,
):
    """Carry out ``plan``'s steps as a runner would (a shed on ``log``, a wait moves the clock,
    each request answered by ``answer(step, now)``, the routing read by ``refresh()``); returns
    the steps up to its end."""
    steps = []
    for _ in range(limit):
        step = plan.next(now)
        steps.append(step)
        if isinstance(step, (Done, GiveUp)):
            return steps
        if isinstance(step, Refresh) and refresh is not None:
            refresh()
        elif isinstance(step, Shed):
            assert log is not None
            log.shed(step.below, step.primaries)
        elif isinstance(step, Wait):
            now += step.seconds
        elif isinstance(step, (Replay, Ask, Deliver)) and answer is not None:
            now = answer(step, now) or now
    return steps


def kinds(steps) -> list[str]:
    return [type(s).__name__ for s in steps]


def test_the_budget_is_the_setting_and_never_under_two_pushes_of_the_model():
    assert replay_budget(1 << 20, 1000) == 1 << 20
    assert replay_budget(0, 1000) == 8000  # two pushes of 1000 float32


def test_under_the_budget_a_push_goes_at_once_and_not_urgent():
    log = ReplayLog()
    held(log, 1, 0, 1)
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 8 * PART, TIMEOUT, INTERVAL)
    push = a_push()
    pushing = plan.push(push)
    assert kinds(walk(pushing, log=log)) == ["Deliver", "Done"]
    assert not push.urgent and not pushing.made_room


def test_past_half_the_budget_the_push_asks_its_primaries_to_forward_at_once():
    log = ReplayLog()
    for pid in range(3):
        held(log, pid, 0, pid + 1)  # 48 bytes held, the budget 80: past half, room enough
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 5 * PART, TIMEOUT, INTERVAL)
    push = a_push()
    assert kinds(walk(plan.push(push), log=log)) == ["Deliver", "Done"]
    assert push.urgent


def test_a_budget_reached_sheds_what_waits_for_the_checkpoint_then_asks_urgently():
    """Over the budget: what every copy holds goes first (it waits for the checkpoint alone);
    while that is not room enough, the primaries are asked what every copy holds, urgently
    (they forward at once), and what that answer made wait for the checkpoint alone goes too."""
    log = ReplayLog()
    for pid in range(4):
        held(log, pid, 0, pid + 1)
    log.confirm(0, "a", 0, 2, durable=0)  # every copy holds pushes 0 and 1, not the checkpoint
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 3 * PART, TIMEOUT, INTERVAL)
    push = a_push()

    def answer(step, now):
        if isinstance(step, Ask):
            assert step.request.op == "confirmed" and step.request.urgent
            assert step.request.sids == (0,)
            log.confirm(0, "a", 0, 4, durable=0)  # the forward went: every copy holds all

    pushing = plan.push(push)
    steps = walk(pushing, answer=answer, log=log)
    # room for a push of 32 bytes under 48: at most 16 held. Read the routing, shed 0 and 1
    # (32 left, not enough: 2 and 3 are on the primary alone); ask urgently; read the routing,
    # shed 2: 16 held, room
    assert kinds(steps) == ["Refresh", "Shed", "Ask", "Refresh", "Shed", "Deliver", "Done"]
    assert steps[1] == steps[4] == Shed(PART, {0: ("a", 0), 1: ("a", 0)})
    assert [h.push_id for h in log.held(0)] == [3] and pushing.made_room
    assert not push.urgent  # 16 bytes held of 48: not past half


def test_a_shed_reads_the_routing_first_so_a_shard_rebuilt_without_its_copies_keeps_them():
    """The pusher's copy of the routing still names the primary that every copy of shard 0
    confirmed; since it was read, every copy was lost and the controller rebuilds the shard from
    the checkpoint. The shed reads the routing first, and keeps those pushes (they are replayed
    to the rebuilt shard) instead of letting them go as if they waited for the checkpoint alone
    (the simulation found it: seeds 10173 and 4 more of 100,000)."""
    log = ReplayLog()
    for pid in range(4):
        held(log, pid, 0, pid + 1)
    log.confirm(0, "a", 0, 4, durable=0)  # every copy held all four, the checkpoint none
    r = routing(["a", "a"])
    plan = CourierPlan(log, r, SHARDS, 3 * PART, TIMEOUT, INTERVAL)

    def rebuilt():
        r.set(
            {
                "routing": [[], ["a", "x", "y"]],
                "gens": [0, 0],
                "nodes": {},
                "pending": [0],
                "lost": [],
                "generation": 3,
                "healthy": False,
            }
        )

    steps = walk(plan.push(a_push()), log=log, refresh=rebuilt, limit=2)
    assert kinds(steps) == ["Refresh", "Shed"]
    assert 0 not in steps[1].primaries
    assert [h.push_id for h in log.held(0)] == [0, 1, 2, 3]


def test_waiting_for_room_asks_again_after_a_short_wait_until_the_copies_hold_them():
    log = ReplayLog()
    for pid in range(3):
        held(log, pid, 0, pid + 1)
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 4 * PART, TIMEOUT, INTERVAL)
    asked = []

    def answer(step, now):
        if isinstance(step, Ask):
            asked.append(now)
            if len(asked) == 3:  # the third answer says every copy and the checkpoint hold 2
                log.confirm(0, "a", 0, 2, durable=2)

    steps = walk(plan.push(a_push()), answer=answer, log=log)
    # nothing every copy holds to shed: the push waits, asking after 2 ms, then 4 ms; each
    # shed on a routing read just before
    assert kinds(steps) == ["Refresh", "Shed"] + ["Ask", "Refresh", "Shed", "Wait"] * 2 + [
        "Ask",
        "Refresh",
        "Shed",
        "Deliver",
        "Done",
    ]
    assert [s.seconds for s in steps if isinstance(s, Wait)] == [0.002, 0.004]
    assert len(log) == 1


def test_waiting_for_room_backs_off_while_nothing_is_let_go_and_starts_again_on_progress():
    """A pusher waiting for slow copies asks less and less often, to half the forward
    interval, and reads the routing at most that often; once something is let go it asks
    quickly again (the copies are moving)."""
    log = ReplayLog()
    for pid in range(4):  # 64 bytes held; room for the push's 32 under 64: two must go
        held(log, pid, 0, pid + 1)
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 4 * PART, TIMEOUT, INTERVAL)
    asked = []

    def answer(step, now):
        if isinstance(step, Ask):
            asked.append(now)
            if now >= 10.0 and len(log) == 4:  # the copies catch up on push 0 at 10 s
                log.confirm(0, "a", 0, 1, durable=1)
            elif now >= 20.0:  # and on push 1 at 20 s: room
                log.confirm(0, "a", 0, 2, durable=2)

    steps = walk(plan.push(a_push()), answer=answer, log=log, limit=1000)
    assert kinds(steps[-2:]) == ["Deliver", "Done"]
    waits = [s.seconds for s in steps if isinstance(s, Wait)]
    assert max(waits) == INTERVAL / 2  # backed off to half the forward interval
    assert waits[:4] == [0.002, 0.004, 0.008, 0.016]
    after = waits[waits.index(INTERVAL / 2) :]
    assert 0.002 in after  # progress at 10 s: short waits again
    # every shed on a routing read just before; the other reads (for the replays) at most
    # every half forward interval
    assert all(
        isinstance(steps[i - 1], Refresh) for i, s in enumerate(steps) if isinstance(s, Shed)
    )
    replay_reads = [
        i
        for i, s in enumerate(steps)
        if isinstance(s, Refresh) and not isinstance(steps[i + 1], Shed)
    ]
    clock, read_times = 0.0, []
    for i, s in enumerate(steps):
        if i in replay_reads:
            read_times.append(clock)
        if isinstance(s, Wait):
            clock += s.seconds
    gaps = np.diff(read_times)
    assert len(asked) < 60 and (gaps >= INTERVAL / 2).all()  # at 2 ms: ~10,000 asks


def test_a_moved_primary_makes_the_push_replay_its_held_pushes_first():
    log = ReplayLog()
    held(log, 1, 0, 5)
    held(log, 2, 0, 6)
    held(log, 3, 1, 2, primary="b")
    r = routing(["c", "b"], gens=[1, 0])  # shard 0 moved to c (generation 1)
    plan = CourierPlan(log, r, SHARDS, 1 << 20, TIMEOUT, INTERVAL)
    sent = []

    def answer(step, now):
        req = step.request
        sent.append((type(step).__name__, req.push_id, req.sids))
        if isinstance(step, Replay):
            assert req.args == {"replay": True} and req.values.tolist() == [1.0] * 4
            log.acknowledged(req.sids[0], req.push_id, "c", 1, 10 + req.push_id)

    steps = walk(plan.push(a_push(99)), answer=answer, log=log)
    assert kinds(steps) == ["Replay", "Replay", "Deliver", "Done"]
    assert sent == [("Replay", 1, (0,)), ("Replay", 2, (0,)), ("Deliver", 99, (0, 1))]


def test_a_push_whose_shard_moved_is_replayed_not_shed():
    """Every copy held it, but of a lineage that is gone (the shard was rebuilt from the
    checkpoint, generation 1): making room replays it to the new primary instead of letting it
    go (found by the simulation, seed 17 with the least budget)."""
    log = ReplayLog()
    held(log, 1, 0, 5)
    held(log, 2, 0, 6)
    log.confirm(0, "a", 0, 6, durable=4)  # replicated, by the lineage of generation 0
    plan = CourierPlan(log, routing(["c", "a"], gens=[1, 0]), SHARDS, 3 * PART, TIMEOUT, INTERVAL)

    def answer(step, now):
        if isinstance(step, Replay):
            log.acknowledged(0, step.request.push_id, "c", 1, step.request.push_id)
        elif isinstance(step, Ask):
            log.confirm(0, "c", 1, 2, durable=2)

    steps = walk(plan.push(a_push()), answer=answer, log=log)
    assert kinds(steps) == [
        "Refresh",
        "Shed",
        "Replay",
        "Replay",
        "Ask",
        "Refresh",
        "Shed",
        "Deliver",
        "Done",
    ]
    assert not log  # both replayed, then durable at the new primary: none was let go of


def test_a_replay_is_made_from_the_log_just_before_it_is_sent():
    """The answer to one replay may make the next held push durable: it is not sent again."""
    log = ReplayLog()
    held(log, 1, 0, 5)
    held(log, 2, 0, 6)
    plan = CourierPlan(log, routing(["c", "b"], gens=[1, 0]), SHARDS, 1 << 20, TIMEOUT, INTERVAL)

    def answer(step, now):
        log.acknowledged(0, step.request.push_id, "c", 1, 7)
        log.confirm(0, "a", 0, 6)  # a late word of the old primary: both durable there

    steps = walk(plan.replay(), answer=answer, log=log)
    assert kinds(steps) == ["Replay", "Done"]
    assert [h.push_id for h in log.held(0)] == [1]


def test_no_progress_past_the_failover_timeout_gives_up_while_a_copy_lacks_a_push():
    log = ReplayLog()
    held(log, 1, 0, 5)  # on the primary alone
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 1 << 20, TIMEOUT, INTERVAL)
    settling = plan.settle(0.0)
    steps = walk(settling, log=log, limit=1000)
    assert kinds(steps[:4]) == ["Refresh", "Ask", "Wait", "Refresh"]
    assert steps[2] == Wait(1.0)  # half the forward interval between rounds
    last = steps[-1]
    assert isinstance(last, GiveUp) and isinstance(last.error, ShardUnavailable)
    assert last.error.shard == 0
    waited = sum(s.seconds for s in steps if isinstance(s, Wait))
    assert TIMEOUT <= waited <= TIMEOUT + 1.0


def test_progress_starts_the_failover_timeout_again():
    log = ReplayLog()
    for pid in range(3):
        held(log, pid, 0, pid + 1)
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 1 << 20, TIMEOUT, INTERVAL)
    settling = plan.settle(0.0)

    def answer(step, now):
        if now > 50 and len(log) == 3:  # one push becomes durable at 50 s
            log.confirm(0, "a", 0, 1)

    steps = walk(settling, answer=answer, log=log, limit=1000)
    assert isinstance(steps[-1], GiveUp)
    waited = sum(s.seconds for s in steps if isinstance(s, Wait))
    assert waited > 50 + TIMEOUT  # not at 60 s: the held bytes went down at 50


def test_only_the_checkpoint_behind_keeps_waiting():
    """Every copy holds the held pushes; the checkpoint is behind (a storage outage): past the
    fail-over timeout it keeps asking, and ends when the checkpoint catches up."""
    log = ReplayLog()
    held(log, 1, 0, 5)
    log.confirm(0, "a", 0, 5, durable=4)
    assert log.unreplicated == 0
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 1 << 20, TIMEOUT, INTERVAL)

    def answer(step, now):
        if now > 3 * TIMEOUT:
            log.confirm(0, "a", 0, 5, durable=5)

    steps = walk(plan.settle(0.0), answer=answer, log=log, limit=10000)
    assert not any(isinstance(s, GiveUp) for s in steps)
    assert isinstance(steps[-1], Done) and not log


def test_settling_for_the_copies_alone_ends_when_every_copy_holds_them():
    log = ReplayLog()
    held(log, 1, 0, 5)
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 1 << 20, TIMEOUT, INTERVAL)

    def answer(step, now):
        log.confirm(0, "a", 0, 5, durable=-1)

    steps = walk(plan.settle(0.0, copies_only=True), answer=answer, log=log)
    assert kinds(steps) == ["Refresh", "Ask", "Done"] and len(log) == 1


def test_settling_gives_up_after_its_limit():
    log = ReplayLog()
    held(log, 1, 0, 5)
    log.confirm(0, "a", 0, 5, durable=4)  # only the checkpoint behind: no ShardUnavailable
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 1 << 20, TIMEOUT, INTERVAL)
    steps = walk(plan.settle(0.0, limit=5.0), log=log)
    last = steps[-1]
    assert isinstance(last, GiveUp) and isinstance(last.error, TimeoutError)
    with pytest.raises(TimeoutError, match=r"not durable in 5\.0s"):
        raise last.error


def test_a_push_that_keeps_nothing_makes_no_room():
    log = ReplayLog()
    for pid in range(8):
        held(log, pid, 0, pid + 1)
    plan = CourierPlan(log, routing(["a", "a"]), SHARDS, 2 * PART, TIMEOUT, INTERVAL)
    push = a_push()
    push.ack = "all"
    assert kinds(walk(plan.push(push), log=log)) == ["Deliver", "Done"]
    assert len(log) == 8 and not push.urgent
