"""ReplayLog: the pusher's record of acknowledged pushes not yet durable: held by every copy and,
with a checkpoint, by the block the manifest names (no Dask)."""

from __future__ import annotations

from adam_dask.ps._replay import HeldPush, ReplayLog


def held(pid: int, primary: str, version: int, gen: int = 0) -> HeldPush:
    return HeldPush(pid, "push", None, primary, gen, version, 10)


def test_confirm_drops_only_what_that_primary_confirmed():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.add(0, held(2, "a", 6))
    log.add(1, held(1, "b", 3))
    assert log.confirm(0, "a", 0, 5) == 1
    assert log.confirm(0, "z", 0, 99) == 0  # another node's word does not count
    assert log.confirm(0, "a", 1, 99) == 0  # nor that of another generation on that address
    assert [h.push_id for h in log.held(0)] == [2]
    assert len(log) == 2 and log.nbytes == 20
    assert log.shards() == [0, 1]


def test_moved_lists_pushes_acknowledged_by_a_former_primary():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.add(0, held(2, "a", 6))
    log.add(1, held(3, "b", 1))
    moved = log.moved({0: ("c", 4), 1: ("b", 0)})
    assert {s: [h.push_id for h in hs] for s, hs in moved.items()} == {0: [1, 2]}
    assert list(log.moved({0: ("a", 4), 1: ("b", 0)})) == [0]  # same address, new generation
    log.acknowledged(0, 1, "c", 4, 9)  # replayed: now held for the new primary's version 9
    log.acknowledged(0, 2, "c", 4, 10)
    assert log.moved({0: ("c", 4), 1: ("b", 0)}) == {}
    assert log.confirm(0, "c", 4, 9) == 1 and len(log) == 2
    log.clear()
    assert not log and log.nbytes == 0


def test_a_push_every_copy_holds_waits_for_the_checkpoint():
    log = ReplayLog()
    for pid, version in ((1, 5), (2, 6), (3, 7)):
        log.add(0, held(pid, "a", version))
    # every copy holds up to 6, the checkpoint up to 5: push 1 goes, push 2 waits, replicated
    assert log.confirm(0, "a", 0, 6, durable=5) == 1
    assert [(h.push_id, h.replicated) for h in log.held(0)] == [(2, True), (3, False)]
    assert log.unreplicated == 1
    assert log.confirm(0, "a", 0, 6, durable=9) == 1  # durable never runs ahead of the copies
    assert [h.push_id for h in log.held(0)] == [3]
    assert log.confirm(0, "a", 0, 7, durable=None) == 1  # a flush's word: both at once
    assert not log


def test_a_replayed_push_is_replicated_again_only_by_its_new_primary():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.confirm(0, "a", 0, 5, durable=4)
    assert log.unreplicated == 0
    log.acknowledged(0, 1, "c", 1, 2)  # replayed to the restored shard's primary
    assert log.unreplicated == 1


def test_shed_lets_go_of_replicated_pushes_only():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.add(0, held(2, "a", 6))
    log.add(1, held(3, "b", 1))
    log.confirm(0, "a", 0, 6, durable=-1)  # the checkpoint is behind (a storage outage)
    assert log.shed(below=25) == 1 and log.nbytes == 20  # the oldest replicated one first
    assert log.shed(below=0) == 1  # push 3 is not on every copy yet: it stays
    assert [h.push_id for h in log.held(1)] == [3] and log.nbytes == 10


def test_answers_fill_and_empty_the_log_and_moved_pushes_become_replays():
    """The rules the client's courier and the simulation's pushers share: a push's answer keeps
    its shards' parts and drops what the answer says is durable; a moved push becomes a replay
    request (same id, the shard's part); the replay's answer moves it to the new primary; a
    ``confirmed`` answer drops it."""
    import numpy as np

    from adam_dask.ps._request import Request

    shards = [(0, 2), (2, 4)]
    values = np.arange(4, dtype=np.float32)
    push = Request("push", (0, 1), 7, "replay", values=values)
    log = ReplayLog()

    def hold(sid: int, gen: int, version: int) -> HeldPush:
        a, b = shards[sid]
        return HeldPush(7, "push", values[a:b].copy(), "a", gen, version, 8)

    reply = {
        "per_shard": {0: 3, 1: 5},
        "gens": {0: 1, 1: 1},
        "confirmed": {0: 3, 1: 4},
        "durable": {0: 3, 1: 4},
    }
    log.answered(push, "a", reply, hold)
    assert log.shards() == [1]  # shard 0's part is durable already
    assert log.question() == Request("confirmed", (1,))

    (replay,) = log.replays({0: ("a", 1), 1: ("b", 2)}, shards)
    assert (replay.sids, replay.push_id, replay.args) == ((1,), 7, {"replay": True})
    assert replay.values.tolist() == [2.0, 3.0] and replay.base == 2
    log.answered(replay, "b", {"per_shard": {1: 9}, "gens": {1: 2}, "confirmed": {}}, hold)
    assert log.replayed == 1 and not log.replays({1: ("b", 2)}, shards)

    asked = log.question()
    assert asked is not None
    log.answered(asked, "b", {"per_shard": {1: 9}, "durable": {1: 9}, "gens": {1: 2}}, hold)
    assert not log and log.question() is None
