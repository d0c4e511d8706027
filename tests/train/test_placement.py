"""Replica placement (adam_dask.train.placement): a replica re-run after its TRAIN worker was
lost, which Dask queues beside a running replica, moves to the worker that replaces the lost one
instead of waiting for the whole of the other replica."""

from __future__ import annotations

import time

import pytest

import adam_dask
from adam_dask.cluster import TRAIN, workers_with_role
from adam_dask.testing import fit_in_background, hard_kill, join_fit, synthetic_store
from adam_dask.train.placement import Slots, plan_moves
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


def test_a_task_queued_behind_a_held_slot_moves_to_a_free_one():
    workers = {
        "a": Slots(1, held=1, queued=[("r0", 1)]),  # a re-run beside a running replica
        "b": Slots(1),  # the replacement, idle
    }
    assert plan_moves(workers) == [("r0", "a", "b")]
    assert workers["a"].queued == [("r0", 1)]  # pure: its input unchanged


def test_a_task_that_can_start_where_it_is_stays():
    # a just-placed replica on an idle worker has not seceded yet: it holds nothing yet
    assert plan_moves({"a": Slots(1, queued=[("r0", 1)]), "b": Slots(1)}) == []
    # two queued on one worker: the first starts there, the second moves
    got = plan_moves({"a": Slots(1, queued=[("r0", 1), ("r1", 1)]), "b": Slots(1)})
    assert got == [("r1", "a", "b")]


def test_nowhere_free_nothing_moves_and_each_free_slot_takes_one():
    assert plan_moves({"a": Slots(1, 1, [("r0", 1)]), "b": Slots(1, 1)}) == []
    got = plan_moves(
        {
            "a": Slots(1, 1, [("r0", 1), ("r1", 1)]),
            "b": Slots(1),
            "c": Slots(2, 1),  # a worker of two slots, one held
        }
    )
    assert sorted(t for _, _, t in got) == ["b", "c"] and {k for k, _, _ in got} == {"r0", "r1"}


def test_a_worker_with_its_own_queue_is_the_last_choice():
    got = plan_moves({"a": Slots(1, 1, [("r0", 1)]), "b": Slots(1, 0, [("s0", 1)]), "c": Slots(1)})
    assert got == [("r0", "a", "c")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("placement-data"), n_train=1024, n_test=256)


@pytest.mark.timeout(600)
def test_a_lost_replica_reruns_on_the_replacement_worker(store):
    """A TRAIN worker killed mid-epoch (its nanny starts a fresh one, a replacement pod): the
    lost replica's re-run trains on the fresh worker, beside the surviving replica, not after
    it on the survivor's worker."""
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        t = Trainer(
            store,
            model=SPEC,
            client=client,
            lr=0.05,
            push_every=64,
            batch_size=8,
            progress=False,
            epoch_quorum=1.0,
            # ~1 s per served batch of 64: 8 s per replica's share, long enough for the fresh
            # worker to join while the survivor still trains
            slow_replicas={0: 1.0, 1: 1.0},
        )
        th, box = fit_in_background(t, epochs=1)
        try:
            deadline = time.monotonic() + 300
            while sum(t._progress_state.values()) < 128:
                assert time.monotonic() < deadline and "error" not in box, box
                time.sleep(0.05)
            before = set(workers_with_role(client, TRAIN))
            victim = sorted(before)[0]
            hard_kill(client, [victim])
            join_fit(th, client, 300)
            assert "error" not in box, box.get("error")
            rec = box["history"].records[0]
            assert rec["images_applied"] == 1024 and rec["replicas_finished"] == 2, rec
            fresh = set(workers_with_role(client, TRAIN)) - before
            assert fresh, "the nanny started no fresh TRAIN worker"
            ran = rec["replica_workers"]
            assert victim not in ran and set(ran) & fresh, ran  # the re-run on the fresh one
            assert len(set(ran)) == 2, ran
        finally:
            t.close()
