"""Training goes on through parameter-server faults sent from the test process, at the default
PS settings: a primary frozen (SIGSTOP) mid-training, and every holder of a shard killed
(SIGKILL), which the controller rebuilds from the checkpoint without a restart."""

from __future__ import annotations

import signal
import time

import dask
import pytest

import adam_dask
from adam_dask.ps.runtime.rpc import call_actor
from adam_dask.testing import (
    fit_in_background,
    freeze,
    hard_kill,
    join_fit,
    role_worker,
    synthetic_store,
    thaw,
    wait_for_pushes,
)
from adam_dask.train.trainer import Trainer

# every test beside three busy processes per core (tests/conftest.py)

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("ps-fault-data"), n_train=1024, n_test=256)


@pytest.fixture
def cluster():
    # 5 PS workers: one frozen, or three killed (their nanny brings them back under new
    # addresses), still leaves live workers to promote on, rebuild on and copy to
    with adam_dask.cluster.local(
        ps_nodes=5, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        yield client


@pytest.fixture
def silent_host():
    """The frozen worker is a host gone silent, not a hung process its nanny replaces
    (``adam.ps.replace-retired`` off): it must still be there to be asked once it wakes."""
    with dask.config.set({"adam.ps.replace-retired": False}):
        yield


def trainer(store, client, **kwargs):
    return Trainer(
        store,
        model=SPEC,
        client=client,
        lr=0.05,
        push_every=64,
        batch_size=8,
        progress=False,
        shard_bytes=4096,  # a few shards: faults hit some, not all
        slow_replicas={0: 0.02, 1: 0.02},  # the faults land mid-epoch
        **kwargs,
    )


def check_every_image_applied_once_on_the_plane(t, hist):
    """Every image trained was applied once (two replicas: the quorum is both), and every push
    and pull the live nodes served came over the data plane, none as a Dask actor call."""
    assert hist.column("images_applied") == hist.column("images"), hist.records
    nodes = [n for n in t.server.stats()["nodes"].values() if isinstance(n, dict)]
    moved = {k: sum(n["by_transport"][k] for n in nodes) for k in ("plane", "dask")}
    assert moved["plane"] > 0 and moved["dask"] == 0, moved


@pytest.mark.usefixtures("busy_load")  # beside 3 busy processes per core
@pytest.mark.timeout(900)  # a cluster of 8 workers training on 2 shared cores
@pytest.mark.usefixtures("silent_host")
def test_training_through_a_frozen_primary(store, cluster):
    t = trainer(store, cluster)
    th, box = fit_in_background(t, epochs=2)
    frozen: dict = {}
    try:
        wait_for_pushes(t, box, 40)
        info = t.server.routing_info()
        victim = info["routing"][0][0]
        old_key = info["nodes"][victim]
        frozen = freeze(cluster, [victim])
        deadline = time.time() + 120
        while time.time() < deadline:  # the controller replaces it while training goes on
            r = t.server.routing_info()
            if victim not in r["nodes"] and r["routing"][0][0] != victim and not r["pending"]:
                break
            time.sleep(0.1)
        thaw(frozen)
        frozen = {}
        assert victim not in r["nodes"], r
        join_fit(th, cluster, 600)
        assert "error" not in box, box.get("error")
        assert box["history"].last["test_accuracy"] >= 0.8
        check_every_image_applied_once_on_the_plane(t, box["history"])
        woken = cluster.sync(call_actor, cluster.rpc, victim, old_key, "stats", timeout=30)
        assert not woken["member"] and woken["primaries"] == []  # it serves nothing stale
        assert t.server.stats()["declared_dead"] >= 1
    finally:
        if frozen:
            thaw(frozen)
        t.close()


@pytest.mark.usefixtures("busy_load")
@pytest.mark.timeout(900)
def test_training_through_the_loss_of_every_copy_of_a_shard(store, cluster, tmp_path):
    t = trainer(store, cluster, checkpoint=str(tmp_path / "ckpt"))
    th, box = fit_in_background(t, epochs=2)
    try:
        wait_for_pushes(t, box, 40)
        before = t.server.placement()
        holders = before[1]
        hard_kill(cluster, holders)  # every copy of shard 1 at once
        join_fit(th, cluster, 600)
        assert "error" not in box, box.get("error")
        assert box["history"].last["test_accuracy"] >= 0.8
        check_every_image_applied_once_on_the_plane(t, box["history"])
        stats = t.server.stats()
        restored = {r["shard"] for r in stats["restored"]}  # rebuilt from the checkpoint
        assert 1 in restored
        assert all(set(before[s]) <= set(holders) for s in restored)  # only shards lost whole
        deadline = time.time() + 120
        while not (info := t.server.routing_info())["healthy"] and time.time() < deadline:
            time.sleep(0.2)
        assert info["healthy"], info
        assert len(info["routing"][1]) == 3 and not set(info["routing"][1]) & set(holders)
    finally:
        t.close()


@pytest.mark.usefixtures("busy_load")  # beside 3 busy processes per core
@pytest.mark.timeout(900)
def test_training_through_a_ps_worker_evicted(store, tmp_path):
    """SIGTERM to a PS worker's own process mid-training (a pod evicted: its worker closes
    gracefully, its copies and primaries go with it), sent from this process: the controller
    fails its shards over, training goes on, and every image is applied once."""
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        proc = role_worker(client.scheduler.address, "PS", name="ps-evicted", host="127.0.0.9")
        t = None
        try:
            deadline = time.monotonic() + 120
            while not any(
                w.get("name") == "ps-evicted"
                for w in client.scheduler_info(n_workers=-1)["workers"].values()
            ):
                assert time.monotonic() < deadline, "the PS worker did not join"
                time.sleep(0.2)
            t = trainer(store, client, checkpoint=str(tmp_path / "ckpt"))
            th, box = fit_in_background(t, epochs=2)
            wait_for_pushes(t, box, 20)
            held = {a for copies in t.server.placement().values() for a in copies}
            assert any("127.0.0.9:" in a for a in held), held  # the evicted worker held copies
            proc.send_signal(signal.SIGTERM)  # from outside, as the kubelet does
            assert proc.wait(timeout=60) is not None
            join_fit(th, client, 600)
            assert "error" not in box, box.get("error")
            hist = box["history"]
            assert hist.column("images_applied") == hist.column("images"), hist.records
            assert hist.column("images_retrained") == [0, 0]
        finally:
            if t is not None:
                t.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
