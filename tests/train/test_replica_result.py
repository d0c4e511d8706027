"""One result for both kinds of replica: the epoch's record reads a whole-model replica's and a
partitioned one's :class:`ReplicaResult` alike, a field one kind does not measure counting as
nothing from it (no cluster)."""

from __future__ import annotations

import pytest

from adam_dask.train._epoch import epoch_record
from adam_dask.train._result import ReplicaResult


def _whole() -> ReplicaResult:
    return ReplicaResult(
        replica=0,
        epoch=3,
        images=600,
        images_pushed=576,
        loss=0.5,
        seconds=2.0,
        train_seconds=1.8,
        pushes=4,
        ps_seconds=0.2,
        stopped=False,
        workers=("tcp://10.0.0.1:1",),
        threads=2,
        lr_end=0.02,
        images_retrained=64,
        images_before=128,
        stall_fraction=0.1,
        wait_seconds=0.2,
        damping=0.8,
        unreplicated_at_end=0,
    )


def _partitioned() -> ReplicaResult:
    return ReplicaResult(
        replica=1,
        epoch=3,
        images=400,
        images_pushed=384,
        loss=1.0,
        seconds=3.0,
        train_seconds=2.5,
        pushes=6,
        ps_seconds=0.6,
        stopped=True,
        workers=("tcp://10.0.0.3:1", "tcp://10.0.0.2:1"),
        threads=1,
        lr_end=0.01,
        partitions=2,
        cross_bytes=1000,
        attempts=2,
    )


def test_what_only_one_kind_of_replica_measures_is_none_for_the_other():
    whole, part = _whole(), _partitioned()
    assert whole.partitions == 1 and whole.cross_bytes == 0 and whole.attempts is None
    only_whole = ("images_retrained", "images_before", "stall_fraction", "wait_seconds")
    only_whole += ("damping", "unreplicated_at_end")
    assert [getattr(part, f) for f in only_whole] == [None] * len(only_whole)
    assert None not in [getattr(whole, f) for f in only_whole]


def test_the_epoch_record_reads_whole_and_partitioned_results_alike():
    rec = epoch_record(
        3,
        [_whole(), _partitioned()],
        replicas=2,
        seconds=4.0,
        quorum_seconds=2.5,
        flush_seconds=0.1,
        accuracy=0.9,
        ps_before={"pushes_applied": 5},
        ps_after={"pushes_applied": 25},
        lr=0.03,
        lr_end=0.01,
        mode="async",
        images_applied=1000,
    )
    assert rec["images"] == 1000 and rec["images_applied"] == 1000
    assert rec["images_per_second"] == 250.0
    assert rec["loss"] == pytest.approx((0.5 * 600 + 1.0 * 400) / 1000)
    assert rec["images_pushed"] == 576 + 384
    assert rec["images_retrained"] == 64  # the partitioned replica's None adds nothing
    assert rec["stall_fraction"] == 0.1
    assert rec["unreplicated_at_end"] == 0
    assert rec["replica_damping"] == [0.8, 1.0]  # unmeasured: undamped
    assert rec["replica_workers"] == ["tcp://10.0.0.1:1", "tcp://10.0.0.3:1,tcp://10.0.0.2:1"]
    assert rec["replica_threads"] == [1, 2] and rec["replica_lr_end"] == [0.01, 0.02]
    assert rec["replicas_finished"] == 1  # the partitioned one was stopped at the quorum
    assert rec["cross_partition_bytes"] == 1000
    assert rec["push_images"] == pytest.approx((576 + 384) / 10)
    assert rec["exchange_seconds"] == pytest.approx(0.8 / 10)
    assert rec["ps_fraction"] == pytest.approx(0.8 / 5.0)
    assert rec["ps_updates_per_second"] == 5.0
