"""Training through network faults on a cluster of network namespaces, at the default settings:
the run completes and every epoch's images_applied is exact (each image's update applied once)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from adam_dask.testing import NetnsCluster, fit_in_background, netns_problem, synthetic_store
from adam_dask.train.trainer import Trainer

logger = logging.getLogger(__name__)

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
N_TRAIN = 3072


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("net-data"), n_train=N_TRAIN, n_test=256)


@pytest.fixture
def net():
    problem = netns_problem()
    if problem is not None:
        pytest.fail(problem)
    with NetnsCluster(ps_nodes=3, data_nodes=1, trainers=1, memory_limit="1.5GiB") as cluster:
        yield cluster


def trainer(store, client, tmp_path, **kw):
    kw.setdefault("epochs", None)
    return Trainer(
        store,
        client=client,
        model=SPEC,
        lr=0.05,
        push_every=64,
        batch_size=8,
        progress=False,
        checkpoint=str(tmp_path / "ck"),
    )


def run_with_fault(store, net, tmp_path, epochs, fault) -> list[dict]:
    """Fit ``epochs`` while ``fault(net)`` runs in a thread once the first epoch is under way."""
    client = net.client()
    t = trainer(store, client, tmp_path)
    try:
        thread, box = fit_in_background(t, epochs)
        deadline = time.monotonic() + 120
        while not t._progress_state and time.monotonic() < deadline:  # replicas training
            time.sleep(0.05)
        time.sleep(0.5)
        assert thread.is_alive(), "the fit ended before the fault"
        f = threading.Thread(target=fault, args=(net,), daemon=True)
        f.start()
        f.join(120)
        assert thread.is_alive(), "the fit ended during the fault (it did not meet it)"
        thread.join(600)
        assert not thread.is_alive(), "the fit did not finish"
        assert "error" not in box, box.get("error")
        return t.history.records
    finally:
        t.close()


def test_a_train_worker_isolated_for_20_seconds(store, net, tmp_path):
    def fault(n):
        n.cut("train-0")
        time.sleep(20)
        n.reconnect("train-0")

    t0 = time.monotonic()
    records = run_with_fault(store, net, tmp_path, 2, fault)
    assert [r["images_applied"] for r in records] == [N_TRAIN] * 2, records
    logger.warning("TRAIN worker isolated 20 s: 2 epochs in %.1fs", time.monotonic() - t0)


def test_the_scheduler_cut_from_every_worker_for_10_seconds(store, net, tmp_path):
    def fault(n):
        n.cut("scheduler")
        time.sleep(10)
        n.reconnect("scheduler")

    t0 = time.monotonic()
    records = run_with_fault(store, net, tmp_path, 2, fault)
    assert [r["images_applied"] for r in records] == [N_TRAIN] * 2, records
    logger.warning("scheduler cut 10 s: 2 epochs in %.1fs", time.monotonic() - t0)
