"""Data positions: a shard fences repeated pushes and keeps their marks with its values, and a
re-run plans from the shards' marks so that every image is applied once per shard."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from adam_dask.errors import ClusterError
from adam_dask.ps.protocol.shard import Mark, ShardState
from adam_dask.train._position import (
    Marker,
    applied_images,
    decode,
    recorded_replicas,
    replica_plan,
    resume_plan,
)

# what each push of a replica covers: {(partition, batch): images}
COVERS = [{(0, 0): 8, (1, 0): 8}, {(0, 0): 8, (0, 1): 4}, {(1, 1): 8, (0, 1): 4}, {(1, 2): 3}]


def _pushes(marker: Marker, covers: list[dict], parts: int = 1) -> list[list[Mark]]:
    out = []
    for c in covers:
        marks = marker.marks(c, parts)
        marker.commit(marks[0])
        out.append(marks)
    return out


def _apply(st: ShardState, mark: Mark, counts: dict) -> None:
    """Push ``mark`` to ``st``; count per image range what the shard applied."""
    before = st.version
    st.apply(np.ones(st.size, np.float32), mark=mark)
    if st.version > before:
        for key, (a, b) in decode(mark.covers).items():
            for i in range(a, b):
                counts[(key, i)] = counts.get((key, i), 0) + 1


def _rerun(shards: list[ShardState], counted: list[dict], epoch: int, rest: list[dict]) -> None:
    """A re-run: plan from the shards' marks, push the stretches, then ``rest``."""
    plan = resume_plan({s: st.marks_of(epoch).get(0, ()) for s, st in enumerate(shards)})
    marker = Marker(epoch, 0, plan.replicas or 1, plan)
    for stretch in plan.stretches:
        mark = marker.marks({k: b - a for k, (a, b) in stretch.items.items()}, 1, stretch)[0]
        for st, c in zip(shards, counted):
            _apply(st, mark, c)
        marker.commit(mark)
    for items in rest:
        mark = marker.marks(items, 1)[0]
        for st, c in zip(shards, counted):
            _apply(st, mark, c)
        marker.commit(mark)


def _every_image_once(counted: list[dict], covers: list[dict]) -> bool:
    images = {((p, k), i) for c in covers for (p, k), n in c.items() for i in range(32)}
    want: dict = {}
    at: dict = {}
    for c in covers:
        for key, n in c.items():
            for i in range(at.get(key, 0), at.get(key, 0) + n):
                want[(key, i)] = 1
            at[key] = at.get(key, 0) + n
    assert set(want) <= images
    return all(c == want for c in counted)


def test_shard_fences_a_repeated_push_and_keeps_marks_with_its_values():
    st = ShardState(0, 0, 4, mark_epochs=2)
    m = _pushes(Marker(0, 1, 2), COVERS[:2])
    one = np.ones(4, np.float32)
    assert st.apply(one, mark=m[0][0]) == 1
    assert st.apply(one, mark=m[0][0]) == 1  # the same number again: skipped
    assert st.apply(one, mark=m[1][0]) == 2
    assert st.pushes_fenced == 1
    assert np.array_equal(st.values, 2 * one)
    assert st.marks_of(0)[1] == (m[0][0], m[1][0])
    copy = ShardState(0, 0, 4)
    snap = st.snapshot()
    assert copy.install(snap.version, snap.values, snap.ids, gen=0, full=True, marks=snap.marks)
    assert copy.fenced(m[1][0]) and copy.fenced(m[0][0])
    assert not copy.fenced(_pushes(Marker(0, 1, 2), COVERS[:3])[2][0])


def test_a_replay_arriving_after_a_newer_push_still_applies():
    """A primary lost push 1 before forwarding it; the pusher's push 2 reaches the new primary
    before the replay of push 1: both apply."""
    m = _pushes(Marker(0, 0, 1), COVERS[:3])
    st = ShardState(0, 0, 1)
    st.apply(np.ones(1, np.float32), mark=m[0][0])
    st.apply(np.ones(1, np.float32), mark=m[2][0])
    st.apply(np.ones(1, np.float32), mark=m[1][0])
    assert st.version == 3 and st.pushes_fenced == 0


def test_shard_keeps_the_newest_epochs_marks_only():
    st = ShardState(0, 0, 2, mark_epochs=2)
    for e in range(4):
        st.apply(np.zeros(2, np.float32), mark=Marker(e, 0, 1).marks({(0, 0): 1}, 1)[0])
    assert sorted(st.marks) == [(2, 0), (3, 0)]


def test_a_rerun_applies_each_image_once_on_every_shard():
    """Shards at different pushes (one in flight when the pusher died, one lost with a
    primary): the stretches, pushed under their numbers, and the rest leave every shard with
    every image once."""
    pushes = _pushes(Marker(3, 0, 2), COVERS[:3])
    shards = [ShardState(s, 0, 1) for s in range(4)]
    counted: list[dict] = [{} for _ in shards]
    for s, got in enumerate([[], [0], [0, 1], [0, 2]]):
        for i in got:
            _apply(shards[s], pushes[i][0], counted[s])
    plan = resume_plan({s: st.marks_of(3).get(0, ()) for s, st in enumerate(shards)})
    assert plan.replicas == 2 and [stretch.seq for stretch in plan.stretches] == [0, 1, 2]
    assert plan.next_seq == 3
    _rerun(shards, counted, 3, [COVERS[3]])
    assert _every_image_once(counted, COVERS)
    marks = {s: st.marks_of(3) for s, st in enumerate(shards)}
    assert applied_images(marks) == sum(sum(c.values()) for c in COVERS)
    assert recorded_replicas(marks) == 2


def test_a_push_lost_on_every_shard_is_retrained_under_a_new_number():
    pushes = _pushes(Marker(0, 0, 1), COVERS)
    shards = [ShardState(0, 0, 1), ShardState(1, 0, 1)]
    counted: list[dict] = [{}, {}]
    for st, c in zip(shards, counted):
        for i in (0, 2, 3):  # push 1 reached no shard
            _apply(st, pushes[i][0], c)
    plan = resume_plan({s: st.marks_of(0).get(0, ()) for s, st in enumerate(shards)})
    # the images of batch (0, 1) before those push 2 holds are a stretch; those of (0, 0) come
    # after every range recorded: the rest of the share trains them
    assert [(stretch.seq, stretch.images) for stretch in plan.stretches] == [(4, 4)]
    assert plan.position[(0, 0)] == 8
    _rerun(shards, counted, 0, [{(0, 0): 8}])
    assert _every_image_once(counted, COVERS)


def test_offloaded_parts_are_fenced_one_by_one_and_checked_per_target():
    marks = Marker(0, 0, 1).marks({(0, 0): 8}, 2)
    outer = dataclasses.replace(marks[1], targets=(1,))
    a, b = ShardState(0, 0, 1), ShardState(1, 0, 1)
    for st in (a, b):
        st.apply(np.ones(1, np.float32), mark=marks[0])
    assert not resume_plan({0: a.marks_of(0)[0], 1: b.marks_of(0)[0]}).stretches == ()
    b.apply(np.ones(1, np.float32), mark=outer)
    assert b.fenced(outer) and not a.fenced(outer)
    plan = resume_plan({0: a.marks_of(0)[0], 1: b.marks_of(0)[0]})
    assert plan.stretches == () and plan.position == {(0, 0): 8} and plan.next_seq == 1


def test_no_marks_no_plan():
    plan = resume_plan({0: (), 1: ()})
    assert not plan.resumed and plan.next_seq == 0 and plan.stretches == ()
    assert applied_images({0: {}, 1: {}}) == 0 and recorded_replicas({0: {}}) is None


def test_a_replicas_plan_reads_its_own_marks_and_refuses_another_replica_count():
    """Replica 1 of 2 plans from its own marks on every shard (replica 0's, further on, do
    not move it); run as one of 3, the shares differ and it is refused, naming the count."""
    shards = [ShardState(s, 0, 1) for s in range(2)]
    for replica, covers in ((0, COVERS), (1, COVERS[:2])):
        for marks in _pushes(Marker(5, replica, 2), covers):
            for st in shards:
                st.apply(np.ones(1, np.float32), mark=marks[0])
    marks = {s: st.marks_of(5) for s, st in enumerate(shards)}
    plan = replica_plan(marks, 5, 1, 2)
    assert plan.next_seq == 2 and plan.stretches == ()
    assert plan.images_done == sum(sum(c.values()) for c in COVERS[:2])
    assert replica_plan(marks, 5, 2, 3).next_seq == 0  # no marks of its own: from the start
    with pytest.raises(ClusterError, match="recorded as one of 2"):
        replica_plan(marks, 5, 1, 3)
