"""Noisy neighbours: a PS worker, then a TRAIN worker, held to 10% of a core from outside (the
kernel's CFS quota on a cgroup of its own, as Kubernetes throttles a pod at its CPU limit; where
no cgroup can be made, SIGSTOP/SIGCONT 90 ms of every 100 ms) for 20 s, ten times the PS
heartbeat timeout, while training runs at the default PS settings. Nothing is lost, every image
is applied once, training goes on meanwhile, and a throttled node that still answers is not
failed over. What it costs an epoch is measured by ``benchmarks/chaos.py --throttle``."""

from __future__ import annotations

import time

import pytest

import adam_dask
from adam_dask.cluster import TRAIN, workers_with_role
from adam_dask.testing import (
    fit_in_background,
    join_fit,
    synthetic_store,
    wait_for_pushes,
    worker_pids,
)
from adam_dask.testing.noise import CpuQuota
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
HELD = 20.0  # seconds under the quota: 10x adam.ps.heartbeat-timeout
FRACTION = 0.1  # of one core


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("throttle-data"), n_train=4096, n_test=256)


@pytest.fixture
def cluster():
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        yield client


def trainer(store, client, slow=0.15, **kwargs):
    return Trainer(
        store,
        model=SPEC,
        client=client,
        lr=0.05,
        push_every=64,
        batch_size=8,
        progress=False,
        shard_bytes=4096,  # a few shards: the throttled worker holds some primaries
        # per served batch of 64: ~6 s an epoch, the run ~36 s (outlasting the quota)
        slow_replicas={0: slow, 1: slow},
        **kwargs,
    )


def hold_under_quota(client, t, box, addr: str) -> dict:
    """The worker at ``addr`` under the quota for HELD seconds of training; what happened then."""
    pid = worker_pids(client, [addr])[addr]
    before = t.server.stats()
    with CpuQuota([pid], FRACTION) as quota:
        deadline = time.monotonic() + HELD
        while time.monotonic() < deadline:
            assert "error" not in box, box["error"]
            assert "history" not in box, "the fit ended while the quota was held: lengthen it"
            time.sleep(0.2)
    after = t.server.stats()
    seen = {
        "quota": quota.stats,
        "pushes": after["pushes_applied"] - before["pushes_applied"],
        "declared_dead": after["declared_dead"] - before["declared_dead"],
        "heartbeat_gap_max": after["heartbeat_gap_max"],
    }
    print("under the quota:", seen)
    return seen


def check_held_back(quota) -> None:
    """The quota bit (the worker wanted more than it allowed in many periods) and held (it used
    no more CPU than allowed, give or take one period's accounting)."""
    assert quota.throttled >= quota.periods / 10, quota
    assert quota.cpu_seconds <= 1.1 * quota.allowed_seconds + 0.1, quota


def check_every_image_once(box):
    assert "error" not in box, box.get("error")
    hist = box["history"]
    print("epoch seconds", [round(x, 1) for x in hist.column("seconds")])
    assert hist.column("images_applied") == hist.column("images"), hist.records
    assert set(hist.column("images_retrained")) == {0}, hist.records


@pytest.mark.timeout(900)
def test_training_through_a_ps_worker_under_a_cpu_quota(store, cluster):
    t = trainer(store, cluster)
    th, box = fit_in_background(t, epochs=6)
    try:
        wait_for_pushes(t, box, 40)
        victim = t.server.routing_info()["routing"][0][0]  # the primary of shard 0
        seen = hold_under_quota(cluster, t, box, victim)
        check_held_back(seen["quota"])
        assert seen["pushes"] > 0, seen  # training went on meanwhile
        join_fit(th, cluster, 600)
        check_every_image_once(box)
        info = t.server.routing_info()
        # it answered, slowly: no fail-over, it still serves its shards
        assert seen["declared_dead"] == 0 and victim in info["nodes"], (seen, info)
        assert t.server.stats()["declared_dead"] == 0
    finally:
        t.close()


@pytest.mark.timeout(900)
def test_training_through_a_train_worker_under_a_cpu_quota(store, cluster):
    # replicas that sleep less (one sleeping most of the time would not reach the quota), for
    # more epochs: the run outlasts the quota
    t = trainer(store, cluster, slow=0.05)
    th, box = fit_in_background(t, epochs=12)
    try:
        wait_for_pushes(t, box, 40)
        victim = workers_with_role(cluster, TRAIN)[0]
        seen = hold_under_quota(cluster, t, box, victim)
        check_held_back(seen["quota"])
        assert seen["pushes"] > 0, seen  # the other replica trained on
        join_fit(th, cluster, 600)
        check_every_image_once(box)
        # the slow replica was waited for, not lost: both replicas finished every epoch
        hist = box["history"]
        assert set(hist.column("replicas_finished")) == {2}, hist.records
        assert victim in workers_with_role(cluster, TRAIN)
        assert t.server.stats()["declared_dead"] == 0
    finally:
        t.close()
