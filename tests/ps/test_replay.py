"""ReplayLog: the pusher's record of acknowledged pushes not yet durable: held by every copy and,
with a checkpoint, by the block the manifest names (no Dask)."""

from __future__ import annotations

from adam_dask.ps.protocol.replay import HeldPush, ReplayLog
from adam_dask.ps.protocol.replies import ConfirmedReply, PushReply


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


def test_shed_keeps_what_a_primary_that_moved_said_every_copy_holds():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.add(1, held(2, "b", 1))
    log.confirm(0, "a", 0, 5, durable=4)
    log.confirm(1, "b", 0, 1, durable=0)
    # shard 0 was rebuilt from the checkpoint (generation 1): its copies that held push 1 may
    # all be gone, so push 1 waits to be replayed; shard 1's primary did not move
    assert log.shed(0, {0: ("a", 1), 1: ("b", 0)}) == 1
    assert [h.push_id for h in log.held(0)] == [1] and not log.held(1)
    assert log.shed(0, {}) == 0  # no primary now (a fail-over under way): nothing goes


def test_answers_fill_and_empty_the_log_and_moved_pushes_become_replays():
    """The rules the client's courier and the simulation's pushers share: a push's answer keeps
    its shards' parts and drops what the answer says is durable; a moved push becomes a replay
    request (same id, the shard's part); the replay's answer moves it to the new primary; a
    ``confirmed`` answer drops it."""
    import numpy as np

    from adam_dask.ps.protocol.request import Request

    shards = [(0, 2), (2, 4)]
    values = np.arange(4, dtype=np.float32)
    push = Request("push", (0, 1), 7, "replay", values=values)
    log = ReplayLog()

    def hold(sid: int, gen: int, version: int) -> HeldPush:
        a, b = shards[sid]
        return HeldPush(7, "push", values[a:b].copy(), "a", gen, version, 8)

    reply = PushReply({0: 3, 1: 5}, confirmed={0: 3, 1: 4}, durable={0: 3, 1: 4}, gens={0: 1, 1: 1})
    log.answered(push, "a", reply, hold)
    assert log.shards() == [1]  # shard 0's part is durable already
    assert log.question() == Request("confirmed", (1,))

    (replay,) = log.replays({0: ("a", 1), 1: ("b", 2)}, shards)
    assert (replay.sids, replay.push_id, replay.args) == ((1,), 7, {"replay": True})
    assert replay.values.tolist() == [2.0, 3.0] and replay.base == 2
    log.answered(replay, "b", PushReply({1: 9}, gens={1: 2}, confirmed={}), hold)
    assert log.replayed == 1 and not log.replays({1: ("b", 2)}, shards)

    asked = log.question()
    assert asked is not None
    log.answered(asked, "b", ConfirmedReply({1: 9}, durable={1: 9}, gens={1: 2}), hold)
    assert not log and log.question() is None


def test_a_replay_after_newer_pushes_is_confirmed_by_version_not_by_place():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.add(0, held(2, "a", 6))
    log.add(0, held(3, "c", 10, gen=1))  # pushed to the new primary before the replays
    log.acknowledged(0, 1, "c", 1, 11)
    log.acknowledged(0, 2, "c", 1, 12)
    assert log.moved({0: ("c", 1)}) == {}
    assert log.confirm(0, "c", 1, 11) == 2  # 10 and 11: not stopped by the 12 before them
    assert [h.push_id for h in log.held(0)] == [2]
    log.add(0, held(4, "c", 13, gen=1))
    assert log.confirm(0, "c", 1, 13, durable=12) == 1
    assert [(h.push_id, h.replicated) for h in log.held(0)] == [(4, True)]


def test_the_log_agrees_with_a_plain_walk_over_random_histories():
    """Every operation on random histories (adds from changing primaries, replays, confirms,
    sheds) leaves the log holding what a plain list walked in full would hold."""
    import random

    for seed in range(200):
        rng = random.Random(seed)
        pick = random.Random(-seed)  # apart from the history's stream
        log = ReplayLog()
        ref: dict[int, list[list]] = {0: [], 1: []}  # [push_id, primary, gen, version, repl]
        version = {("a", 0): 0, ("b", 0): 0, ("a", 1): 0}
        pid = 0
        for _ in range(60):
            sid = rng.randrange(2)
            who = rng.choice(list(version))
            op = rng.random()
            if op < 0.45:
                pid += 1
                version[who] += 1
                log.add(sid, held(pid, who[0], version[who], who[1]))
                ref[sid].append([pid, who[0], who[1], version[who], False])
            elif op < 0.6 and ref[sid]:
                entry = rng.choice(ref[sid])
                version[who] += 1
                log.acknowledged(sid, entry[0], who[0], who[1], version[who])
                entry[1:] = [who[0], who[1], version[who], False]
            elif op < 0.9:
                v = rng.randrange(version[who] + 2)
                d = rng.choice([None, max(v - rng.randrange(3), -1)])
                dur = v if d is None else min(d, v)
                keep = []
                for e in ref[sid]:
                    if (e[1], e[2]) == who and e[3] <= dur:
                        continue
                    if (e[1], e[2]) == who and e[3] <= v:
                        e[4] = True
                    keep.append(e)
                dropped = len(ref[sid]) - len(keep)
                ref[sid] = keep
                assert log.confirm(sid, who[0], who[1], v, d) == dropped, seed
            else:
                below = rng.randrange(0, 10 * (len(ref[0]) + len(ref[1])) + 1)
                log.shed(below)
                total = 10 * (len(ref[0]) + len(ref[1]))
                for s in (0, 1):
                    keep = []
                    for e in ref[s]:
                        if e[4] and total > below:
                            total -= 10
                            continue
                        keep.append(e)
                    ref[s] = keep
            for s in (0, 1):
                got = [(h.push_id, h.primary, h.gen, h.version, h.replicated) for h in log.held(s)]
                assert got == [tuple(e) for e in ref[s]], seed
                now = rng.choice(list(version))
                stale = [e[0] for e in ref[s] if (e[1], e[2]) != now]
                moved = log.moved({s: now}).get(s, [])
                assert [h.push_id for h in moved] == stale, seed
            # the first replay, made alone, is the first of all of them
            now_of = {s: pick.choice(list(version)) for s in (0, 1)}
            replays = log.replays(now_of, [(0, 2), (2, 4)])
            first = log.next_replay(now_of, [(0, 2), (2, 4)])
            if replays:
                assert first is not None, seed
                assert (first.sids, first.push_id) == (replays[0].sids, replays[0].push_id)
            else:
                assert first is None, seed
