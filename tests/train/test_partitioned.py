"""A model replica spread over two TRAIN workers (paper 3.2) on the embedded cluster: it trains
above chance with every image applied once, a partition's worker SIGKILLed mid-epoch from the
test process is survived with images_applied exact, and a plan that does not fit a worker is
refused before anything starts."""

from __future__ import annotations

import sys
import time

import dask
import pytest

import adam_dask
from adam_dask.cluster import TRAIN, workers_with_role
from adam_dask.errors import PartitionError
from adam_dask.testing import (
    fit_in_background,
    hard_kill,
    join_fit,
    synthetic_store,
    wait_for_pushes,
    wait_role_workers,
)
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
N_TRAIN = 1024


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("partition-data"), n_train=N_TRAIN, n_test=256)


@pytest.fixture(scope="module")
def cluster():
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        yield client


def trainer(store, client, **kwargs):
    kwargs.setdefault("partitions", 2)
    kwargs.setdefault("lr", 0.05)
    kwargs.setdefault("push_every", 64)
    return Trainer(
        store,
        model=SPEC,
        client=client,
        batch_size=8,
        progress=False,
        checkpoint=False,
        shard_bytes=4096,  # several shards, one straddling the partitions' edge
        **kwargs,
    )


@pytest.mark.timeout(300)
def test_a_two_partition_replica_trains_above_chance_with_every_image_applied_once(store, cluster):
    train = workers_with_role(cluster, TRAIN)
    before = cluster.run(sys.getswitchinterval, workers=train)
    seen = set()
    # the driver reads the setting when each epoch starts: set for the whole fit
    # and the window: mini-batches in flight in the replica
    config = {"adam.train.partition-switch-interval": 0.00125, "adam.train.partition-window": 3}
    with dask.config.set(config):
        t = trainer(store, cluster)
        th, box = fit_in_background(t, epochs=2)
        try:
            while th.is_alive():  # each partition's worker switches at the configured interval
                now = cluster.run(sys.getswitchinterval, workers=train)
                seen |= {w for w, v in now.items() if v == 0.00125}
                time.sleep(0.05)
            th.join()
        finally:
            t.close()
    assert "error" not in box, box
    hist = box["history"]
    assert seen == set(train)
    assert cluster.run(sys.getswitchinterval, workers=train) == before  # restored after
    assert [len(t.partition_plan), t.replicas, t.partition_plan.window] == [2, 1, 3]
    assert hist.column("images_applied") == [N_TRAIN, N_TRAIN]
    assert hist.records[-1]["test_accuracy"] > 0.5  # chance is 0.1
    # the replica ran on both TRAIN workers, one partition each
    assert len(set(hist.records[-1]["replica_workers"][0].split(","))) == 2


def test_a_plan_over_a_workers_memory_is_refused_naming_the_partition(store, cluster):
    # ~74M parameters: with its accumulators and buffers more than a 2 GiB worker gives
    t = Trainer(store, model="fc8192,fc8192,fc10", client=cluster, progress=False, checkpoint=False)
    with pytest.raises(PartitionError, match=r"partition 0 of 1 .* needs ~[\d,]+ MiB") as e:
        t.fit(epochs=1)
    assert e.value.partition == 0
    assert t.server is None  # refused before the parameter server was created
    assert len(str(e.value).splitlines()) == 1


def test_settings_a_partitioned_replica_does_not_train_with_are_refused(store, cluster):
    t = trainer(store, cluster, mode="sync", momentum=0.9)
    with pytest.raises(PartitionError, match=r"does not train with mode='sync'") as e:
        t.fit(epochs=1)
    assert "momentum" not in str(e.value)  # each partition's threads keep their velocity
    with dask.config.set({"adam.model.dropout": 0.5}):
        t = trainer(store, cluster, offload_dense=True)
        with pytest.raises(PartitionError, match=r"does not train with offload_dense") as e:
            t.fit(epochs=1)
    assert "dropout" not in str(e.value)  # each stage drops its hidden dense layers' outputs
    assert t.server is None


@pytest.mark.timeout(300)
def test_a_two_partition_replica_trains_with_momentum(store, cluster):
    """Momentum in a partitioned replica: each partition's threads keep a velocity over its
    stage, as a whole replica's threads keep one over the model. At this rate the velocity is
    what trains: without momentum two epochs end near 0.3, with it above 0.8."""
    t = trainer(store, cluster, momentum=0.9, lr=0.0005)
    try:
        hist = t.fit(epochs=2)
    finally:
        t.close()
    plan = t.partition_plan
    assert len(plan) == 2 and plan.window == 2 * plan.threads  # the default: P * T
    assert hist.column("images_applied") == [N_TRAIN, N_TRAIN]
    assert hist.records[-1]["test_accuracy"] > 0.6


@pytest.mark.timeout(300)
def test_a_whole_and_a_partitioned_replica_return_one_result_the_epoch_reads(
    store, cluster, epoch_runs
):
    from adam_dask.train._result import ReplicaResult

    runs = epoch_runs
    records = []
    for partitions in (1, 2):
        t = trainer(store, cluster, replicas=1, partitions=partitions)
        try:
            records.append(t.fit(epochs=1).records[0])
        finally:
            t.close()
    assert [[type(r) for r in run.results] for run in runs] == [[ReplicaResult]] * 2
    (whole,), (part,) = (run.results for run in runs)
    for r, rec in ((whole, records[0]), (part, records[1])):
        assert r.images == r.images_pushed == rec["images_applied"] == N_TRAIN
        assert r.pushes > 0 and r.loss == r.loss and r.threads == 1 and not r.stopped
        assert rec["replica_workers"] == [",".join(r.workers)]
        assert rec["cross_partition_bytes"] == r.cross_bytes
    # one runner: both measure the same fields (partition 0 feeds the replica)
    assert [whole.partitions, len(whole.workers), whole.cross_bytes, whole.attempts] == [1, 1, 0, 1]
    assert [part.partitions, len(set(part.workers)), part.attempts] == [2, 2, 1]
    assert part.cross_bytes > 0
    for r in (whole, part):  # one replica: undamped, nothing to re-train, every push held
        assert r.damping == 1.0 and r.images_retrained == 0 and r.images_before == 0
        assert r.unreplicated_at_end == 0 and r.lr_end > 0
    assert records[1]["replica_damping"] == [1.0]
    # partition 0 draws from the data stream: its wait is the replica's, as a whole one's
    for r, rec in ((whole, records[0]), (part, records[1])):
        assert 0.0 <= r.stall_fraction < 1.0 and r.wait_seconds >= 0.0
        assert rec["stall_fraction"] == r.stall_fraction


@pytest.mark.timeout(300)
def test_a_whole_model_trains_as_the_pipelines_one_stage(store, cluster, epoch_runs):
    """A whole-model replica (partitions 1) runs as the partition pipeline's one stage, a
    task each: asynchronous, synchronous (one thread, every step's pushes before its pulls)
    and with the dense offload (its terms through the parameter server's outer-product
    pushes); replicas beyond the TRAIN workers wait for one in turn."""
    runs = epoch_runs
    t = trainer(store, cluster, replicas=2, partitions=1)
    try:
        hist = t.fit(epochs=2)
    finally:
        t.close()
    t = trainer(store, cluster, replicas=2, partitions=1, mode="sync")
    try:
        sync = t.fit(epochs=1)
    finally:
        t.close()
    # the dense offload: fc32's terms cost less than its weights at a push every 16
    t = trainer(store, cluster, replicas=2, partitions=1, offload_dense=True, push_every=16)
    try:
        offload = t.fit(epochs=1)
    finally:
        t.close()
    # three replicas on the module's two TRAIN workers: the third waits for one
    t = trainer(store, cluster, replicas=3, partitions=1)
    try:
        queued = t.fit(epochs=1)
    finally:
        t.close()
    results = [r for run in runs for r in run.results]
    # the pipeline's result (attempts counted), one stage on one worker per replica
    assert [(r.partitions, r.attempts, len(r.workers)) for r in results] == [(1, 1, 1)] * 11
    assert hist.column("images_applied") == [N_TRAIN, N_TRAIN]
    assert hist.records[-1]["test_accuracy"] > 0.5  # chance is 0.1
    assert [r.threads for r in results[4:6]] == [1, 1]  # a synchronous replica's one thread
    assert sync.column("images_applied") == [N_TRAIN]
    assert sync.records[-1]["test_accuracy"] > 0.3
    assert offload.column("images_applied") == [N_TRAIN]
    assert offload.records[-1]["test_accuracy"] > 0.3
    assert queued.column("images_applied") == [N_TRAIN]
    assert len({r.workers for r in results[8:]}) == 2  # three replicas, two workers


@pytest.mark.timeout(300)
def test_sigkill_of_a_partitions_worker_mid_epoch_keeps_images_applied_exact(
    store, cluster, caplog
):
    # it loses a worker: the tests after it wait for the nanny's new one (wait_role_workers)
    t = trainer(store, cluster)
    th, box = fit_in_background(t, epochs=1)
    try:
        wait_for_pushes(t, box, 6, timeout=120)  # mid-epoch: some pushes applied
        train = workers_with_role(cluster, TRAIN)
        assert len(train) == 2
        hard_kill(cluster, [train[1]])  # one partition's worker, mid-epoch
        join_fit(th, cluster, 240)
        assert "error" not in box, box.get("error")
        assert "running it again" in caplog.text  # the replica was re-run after the loss
        hist = box["history"]
        assert hist.column("images_applied") == [N_TRAIN]  # nothing lost, nothing twice
        assert hist.records[0]["test_accuracy"] > 0.2
    finally:
        t.close()
    assert train[1] not in wait_role_workers(cluster, TRAIN, 2)  # the cluster heals


@pytest.mark.timeout(300)
def test_a_two_partition_replica_trains_with_dropout(store, cluster):
    """Dropout on the hidden dense layers in a partitioned replica: each stage drops its hidden
    dense layers' outputs in training (the training loss shows it: 0.78 against 0.33 without,
    measured), and the net still learns."""
    wait_role_workers(cluster, TRAIN, 2)  # a stage per worker, after a kill's replacement
    loss = {}
    for p in (0.0, 0.5):
        with dask.config.set({"adam.model.dropout": p}):
            t = trainer(store, cluster)
            try:
                hist = t.fit(epochs=1)
            finally:
                t.close()
        assert t.net.dropout == p and len(t.partition_plan) == 2
        assert hist.column("images_applied") == [N_TRAIN]
        assert hist.records[-1]["test_accuracy"] > 0.5
        loss[p] = hist.records[-1]["loss"]
    assert loss[0.5] > 1.5 * loss[0.0], loss
