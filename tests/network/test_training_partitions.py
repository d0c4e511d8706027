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


def trainer(store, client, tmp_path):
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


@pytest.mark.parametrize(
    "host, seconds",
    [("train-0", 20), ("scheduler", 15)],
    ids=[
        "a_train_worker_cut_for_20_s",
        # longer than adam.ps.retire-timeout (10 s): the controller, hearing no PS node at
        # all, suspects itself and retires none of them
        "the_scheduler_cut_from_every_worker_for_15_s",
    ],
)
def test_training_through_a_cut_link(store, net, tmp_path, host, seconds):
    def fault(n):
        n.cut(host)
        time.sleep(seconds)
        n.reconnect(host)

    t0 = time.monotonic()
    records = run_with_fault(store, net, tmp_path, 2, fault)
    assert [r["images_applied"] for r in records] == [N_TRAIN] * 2, records
    # no PS worker was removed: not by the controller, and no process of a PS host ended
    assert "removing the silent worker" not in net.log("scheduler")
    assert not [h for h in net.restarts if h.startswith("ps-")], net.restarts
    logger.warning("%s cut %d s: 2 epochs in %.1fs", host, seconds, time.monotonic() - t0)
