"""End-to-end training on the embedded cluster: async, sync, the epoch quorum, failures, resume, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adam_dask.cli import run
from adam_dask.testing import synthetic_store
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"  # small and quick, same kinds of layers as the paper's


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("train-data"), n_train=768, n_test=256)


def fit(store, client, **kw):
    epochs = kw.pop("epochs", 3)
    kw.setdefault("lr", 0.05)
    kw.setdefault("push_every", 64)
    kw.setdefault("batch_size", 8)
    kw.setdefault("progress", False)
    kw.setdefault("model", SPEC)
    t = Trainer(store, client=client, **kw)
    try:
        t.fit(epochs=epochs)
    finally:
        t.close()
    return t


def test_async_training_learns(store, adam_cluster, tmp_path):
    t = fit(store, adam_cluster, mode="async", metrics_out=str(tmp_path / "m.jsonl"))
    h = t.history
    assert len(h) == 3 and h.column("epoch") == [0, 1, 2]
    assert h.last["test_accuracy"] >= 0.9, h.records
    assert h.records[-1]["loss"] < h.records[0]["loss"]
    assert all(r["replicas"] == 2 for r in h)
    # the two replicas ran side by side, one per TRAIN worker, not queued on one
    assert all(len(set(r["replica_workers"])) == 2 for r in h), h.column("replica_workers")
    # threads "auto": each replica runs its TRAIN worker's one thread, not the client's cores
    assert all(r["replica_threads"] == [1, 1] for r in h), h.column("replica_threads")
    # each replica stepped at the schedule's own rate, which falls from lr to lr_end, or below
    # it by the damping its record names (its pushes covered more than the plan's period)
    for r in h:
        low = r["lr_end"] * min(r["replica_damping"]) * 0.999
        assert all(low <= x <= r["lr"] * 1.001 for x in r["replica_lr_end"]), r
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(l)["epoch"] for l in lines] == [0, 1, 2]
    # every image of an epoch was trained on once (the quorum is all of two replicas at 0.75)
    assert h.records[0]["images"] == 768


def test_sync_training_learns_and_resumes_in_sync_mode(store, adam_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    t = fit(store, adam_cluster, mode="sync", epochs=3, checkpoint=ckpt)
    assert t.epoch_quorum == 1.0
    assert t.history.last["test_accuracy"] >= 0.85, t.history.records
    assert t.history.records[0]["images"] == 768
    # resuming (mode not given, as the CLI does without --mode) keeps the synchronous mode
    r = Trainer.resume(ckpt, client=adam_cluster, progress=False, mode=None)
    try:
        assert r.mode == "sync" and r.epoch_quorum == 1.0 and r.epoch == 3
        r.fit(epochs=4)  # the run's total
        assert r.history.column("epoch") == [0, 1, 2, 3]
        assert r.history.last["mode"] == "sync"
    finally:
        r.close()


def test_async_replicas_past_lr_replicas_step_a_share_of_the_rate(store, adam_cluster):
    """lr_replicas=1: two asynchronous replicas each step at half the rate (their deltas add)."""
    t = fit(store, adam_cluster, epochs=1, lr_schedule="constant", lr_replicas=1)
    rec = t.history.last
    assert rec["replica_lr_end"] == pytest.approx([0.025, 0.025]) and rec["lr"] == 0.025
    assert rec["test_accuracy"] > 0.5  # and it learns


def test_auto_push_period_and_rate_follow_the_replicas(store, adam_cluster):
    """push_every and lr_warmup left to auto: two asynchronous replicas of one thread push
    every 256 images at the full rate (2 streams: no warm-up), and what the epoch did is in
    its record; a push period above the auto one damps the rate."""
    t = fit(store, adam_cluster, epochs=1, lr_schedule="constant", push_every=None, threads=1)
    rec = t.history.last
    assert (rec["replicas"], rec["push_every"], rec["lr_warmup"]) == (2, 256, 0.0)
    assert rec["rate_factor"] == 1.0
    # each replica steps the full rate unless its pushes covered more than the plan's period
    # (the exchange damps it then, and says so)
    assert _stepped(rec, 0.05)
    assert t.push_every == 256
    t = fit(store, adam_cluster, epochs=1, lr_schedule="constant", push_every=512, threads=1)
    rec = t.history.last
    assert rec["push_every"] == 512 and rec["rate_factor"] == pytest.approx(0.5)
    assert _stepped(rec, 0.025)


def _stepped(rec: dict, lr: float) -> bool:
    """Each replica of the epoch ended at ``lr``, or below it where the exchange damped it
    (its pushes covered more than the plan's period: its record says so)."""
    ends, damping = rec["replica_lr_end"], rec["replica_damping"]
    if max(ends) > lr * (1 + 1e-6):
        return False
    return ends == pytest.approx([lr] * len(ends)) or min(damping) < 1.0


def test_server_momentum_learns_and_resumes_with_its_momentum(store, adam_cluster, tmp_path):
    """Trainer(server_optimizer="nesterov+staleness"): the server steps with Nesterov momentum
    over staleness-scaled pushes and the run learns; a resumed run gets the optimizer and its
    momentum back."""
    from adam_dask.ps.checkpoint import read_manifest, read_states

    ckpt = str(tmp_path / "ckpt")
    kw = {"lr_schedule": "constant", "lr_replicas": 1, "checkpoint": ckpt}
    t = fit(store, adam_cluster, epochs=2, server_optimizer="nesterov+staleness", **kw)
    assert t.settings.server_optimizer == "nesterov+staleness"
    assert t.history.last["test_accuracy"] >= 0.85, t.history.records
    manifest = read_manifest(ckpt)
    assert manifest["optimizer"]["kind"] == "nesterov" and manifest["optimizer"]["staleness"]
    assert manifest["optimizer"]["momentum"] > 0
    states = read_states(ckpt, None, manifest)
    assert len(states) == len(manifest["shards"]) and any(abs(m).max() > 0 for m in states.values())
    r = Trainer.resume(ckpt, client=adam_cluster, progress=False)
    try:
        assert r.server.optimizer.to_dict() == manifest["optimizer"]
        assert r.settings.server_optimizer == "nesterov+staleness"
        r.fit(epochs=3)
        assert r.history.column("epoch") == [0, 1, 2]
    finally:
        r.close()


def test_sync_mode_with_server_momentum_is_one_outer_step_per_round(store, adam_cluster):
    """mode="sync" with server_optimizer="nesterov" is DiLoCo: every push is marked as its
    replica's share of a synchronous step, so each shard takes a step's shares as one round
    (tests/ps/test_optimizer.py checks the round's arithmetic), and the run learns."""
    t = Trainer(
        store,
        client=adam_cluster,
        mode="sync",
        server_optimizer="nesterov",
        lr=0.05,
        lr_schedule="constant",
        push_every=64,
        batch_size=8,
        model=SPEC,
        progress=False,
    )
    try:
        t.fit(epochs=2)
        marks = [m for per in t.server.marks(1).values() for ms in per.values() for m in ms]
    finally:
        t.close()
    assert marks and all(m.synchronous for m in marks)
    # two replicas, one share each per step: every round of the epoch has both
    rounds: dict = {}
    for m in marks:
        rounds.setdefault((m.round, m.part), set()).add(m.replica)
    assert all(r == {0, 1} for r in rounds.values()), rounds
    assert t.history.last["test_accuracy"] >= 0.85, t.history.records


def test_quorum_ends_epoch_while_straggler_runs(store, adam_cluster):
    """With quorum 0.5 of two replicas, the epoch ends when the fast one is done; the
    deliberately slow one is stopped at once, part-way through its share."""
    t = fit(store, adam_cluster, epochs=1, epoch_quorum=0.5, slow_replicas={1: 1.0})
    rec = t.history.last
    assert rec["replicas_finished"] == 1
    assert rec["images"] < 768  # the straggler did not finish its share
    assert rec["quorum_seconds"] is not None


def test_diverged_model_fails_with_a_clear_error(store, adam_cluster):
    """A learning rate that blows the weights up: the PS refuses the non-finite update and the
    run stops with an error that says what to change."""
    from adam_dask.errors import UpdateRejected

    t = Trainer(
        store, model=SPEC, client=adam_cluster, lr=1e30, push_every=64, batch_size=8, progress=False
    )
    try:
        with pytest.raises(UpdateRejected, match=r"diverged.*lower the learning rate"):
            t.fit(epochs=1)
    finally:
        t.close()


def test_plot_draws_the_history(store, adam_cluster):
    import matplotlib

    matplotlib.use("Agg")
    t = fit(store, adam_cluster, epochs=2)
    fig = t.history.plot()
    loss_ax, acc_ax = fig.axes
    assert len(loss_ax.lines[0].get_xdata()) == 2
    np.testing.assert_allclose(
        acc_ax.lines[0].get_ydata(), [100 * a for a in t.history.column("test_accuracy")]
    )


def test_resume_continues_history(store, adam_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    t = fit(store, adam_cluster, epochs=2, checkpoint=ckpt)
    acc = t.history.last["test_accuracy"]
    r = Trainer.resume(ckpt, client=adam_cluster, progress=False, lr=0.05, push_every=64)
    try:
        assert r.epoch == 2 and len(r.history) == 2
        assert r.epochs == 2  # the plan it was trained with (the schedule's horizon)
        assert abs(r.evaluate() - acc) < 1e-9  # the restored weights are the checkpoint's
        r.fit(epochs=3)  # epochs counts the whole run, as Keras's epochs with initial_epoch
        assert r.history.column("epoch") == [0, 1, 2]
    finally:
        r.close()
    # the CLI evaluates a checkpoint without a cluster
    status = run(["evaluate", ckpt, "--data", store])
    assert status == 0
    # a new run does not write over it unless asked to
    from adam_dask.errors import DestinationExistsError

    with pytest.raises(DestinationExistsError, match="--resume"):
        Trainer(store, model=SPEC, client=adam_cluster, checkpoint=ckpt)
    Trainer(store, model=SPEC, client=adam_cluster, checkpoint=ckpt, overwrite=True).close()


def test_offload_dense_learns(store, adam_cluster):
    """Dense layers send activations and error terms; the PS computes their updates."""
    from adam_dask.model import Network
    from adam_dask.model.partition import profitable_offload

    spec = "conv5x5:6,maxpool2,fc256,fc10"
    assert profitable_offload(Network.from_spec(spec, (1, 28, 28)), 64) == ["2"]
    t = Trainer(
        store,
        client=adam_cluster,
        model=spec,
        offload_dense=True,
        lr=0.05,
        push_every=64,
        batch_size=8,
        progress=False,
    )
    try:
        t.fit(epochs=2)
        nodes = [n for n in t.server.stats()["nodes"].values() if isinstance(n, dict)]
    finally:
        t.close()
    assert t.history.last["test_accuracy"] >= 0.9, t.history.records
    # the offload ran: the nodes computed fc256's updates from activations and errors, at least
    # once per push (768 images an epoch, a push due every 64: pushes due while one is in
    # flight join the next), not from weight deltas
    pushes = sum(round(r["images_pushed"] / r["push_images"]) for r in t.history.records)
    outer = sum(n["outer_products"] for n in nodes)
    assert outer >= pushes >= 2, ([n["outer_products"] for n in nodes], pushes)
    assert t.history.column("images_applied") == t.history.column("images")


def test_batch_norm_network_trains_and_evaluates_with_recomputed_statistics(
    store, adam_cluster, tmp_path
):
    """bn layers (a named option) through the whole system: the replicas push their scale and
    shift like any weight, and each evaluation recomputes the population statistics from the
    training images, in the Trainer and in ``adam-dask evaluate`` of the checkpoint alike."""
    ckpt = str(tmp_path / "ckpt")
    spec = "conv5x5:6,bn,maxpool2,fc32,bn,fc10"
    # average_from 0: epochs 0 and 1 averaged, other weights than the last
    t = fit(store, adam_cluster, model=spec, checkpoint=ckpt, average_from=0.0, epochs=2)
    acc = t.history.last["test_accuracy"]
    assert acc >= 0.9, t.history.records
    assert t.history.last["average_accuracy"] >= 0.9  # the average, calibrated for itself
    averaged = t.averaged_network()
    assert sorted(averaged.population) == [1, 4]
    assert not np.array_equal(averaged.population[1], t.net.population[1])
    assert sorted(t.net.population) == [1, 4]  # the trainer's model can predict as it stands
    scales = t.net.parameters["1.weight"]
    assert not np.allclose(scales, 1.0), "the bn scales were trained through the PS"
    printed: list[str] = []
    assert run(["evaluate", ckpt, "--data", store], out=printed.append) == 0
    assert json.loads(printed[-1])["test_accuracy"] == pytest.approx(acc, abs=1e-9)


def test_replicas_settle_before_their_results_count(store, adam_cluster):
    """With slow forwards (backups 2 s behind their primaries), a replica's last pushes are on
    its primaries only when it stops training; its result comes back once every copy holds them,
    so the epoch's images_applied and manifest count durable pushes only."""
    import dask

    with dask.config.set({"adam.ps.forward-interval": 2.0}):
        t = fit(store, adam_cluster, mode="async", epochs=1)
    rec = t.history.records[0]
    assert rec["unreplicated_at_end"] == 0, rec
    assert rec["images_applied"] == 768, rec


def test_offload_dense_says_when_no_layer_qualifies(store, caplog):
    """--offload-dense on a network whose dense layers are too narrow for it (activations and
    errors would be more bytes than the weight delta) warns instead of doing nothing silently."""
    import logging

    with caplog.at_level(logging.WARNING, logger="adam_dask"):
        t = Trainer(store, model=SPEC, offload_dense=True, momentum=0.0, push_every=64)
        t.close()
    assert any("no dense layer" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adam_dask"):  # a wide layer qualifies: quiet
        t = Trainer(store, model="fc512,fc10", offload_dense=True, momentum=0.0, push_every=8)
        t.close()
    assert not any("no dense layer" in r.getMessage() for r in caplog.records), caplog.text
