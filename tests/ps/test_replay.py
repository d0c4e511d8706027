"""ReplayLog: the pusher's record of acknowledged pushes not yet held by every copy (no Dask)."""

from __future__ import annotations

from adam_dask.ps._replay import HeldPush, ReplayLog


def held(pid: int, primary: str, version: int) -> HeldPush:
    return HeldPush(pid, "push", None, primary, version, 10)


def test_confirm_drops_only_what_that_primary_confirmed():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.add(0, held(2, "a", 6))
    log.add(1, held(1, "b", 3))
    assert log.confirm(0, "a", 5) == 1
    assert log.confirm(0, "z", 99) == 0  # another node's word does not count
    assert [h.push_id for h in log.held(0)] == [2]
    assert len(log) == 2 and log.nbytes == 20
    assert log.shards() == [0, 1]


def test_moved_lists_pushes_acknowledged_by_a_former_primary():
    log = ReplayLog()
    log.add(0, held(1, "a", 5))
    log.add(0, held(2, "a", 6))
    log.add(1, held(3, "b", 1))
    moved = log.moved({0: "c", 1: "b"})
    assert {s: [h.push_id for h in hs] for s, hs in moved.items()} == {0: [1, 2]}
    log.acknowledged(0, 1, "c", 9)  # replayed: now held for the new primary's version 9
    log.acknowledged(0, 2, "c", 10)
    assert log.moved({0: "c", 1: "b"}) == {}
    assert log.confirm(0, "c", 9) == 1 and len(log) == 2
    log.clear()
    assert not log and log.nbytes == 0
