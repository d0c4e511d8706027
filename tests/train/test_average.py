"""Tail averaging: the pure running mean, and the Trainer validating it, storing it with the
checkpoint and going on with it after a resume."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.errors import ConfigError
from adam_dask.testing import synthetic_store
from adam_dask.train._average import TailAverage
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"


def test_the_tail_starts_at_the_fraction_of_the_plan():
    assert TailAverage.planned(0.5, 30).start_epoch == 15
    assert TailAverage.planned(0.0, 30).start_epoch == 0
    assert TailAverage.planned(0.99, 3).start_epoch == 2  # the last epoch at least
    with pytest.raises(ConfigError, match=r"average_from=1.0 must lie in \[0, 1\)"):
        TailAverage.planned(1.0, 10)


def test_the_mean_takes_each_tail_epoch_once_and_survives_its_state():
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=1000).astype(np.float32) for _ in range(5)]
    avg = TailAverage(start_epoch=2)
    taken = [avg.add(e, w) for e, w in enumerate(ws)]
    assert taken == [False, False, True, True, True]
    assert not avg.add(3, ws[0])  # an epoch already in the mean (a retried epoch) is skipped
    np.testing.assert_allclose(avg.weights(), np.mean(ws[2:], axis=0), rtol=1e-6, atol=1e-6)
    assert avg.weights().dtype == np.float32
    again = TailAverage.from_state(*avg.state())
    assert again.epochs == [2, 3, 4]
    np.testing.assert_array_equal(again.weights(), avg.weights())
    with pytest.raises(ValueError, match="no epoch"):
        TailAverage(start_epoch=0).weights()


def test_settings_refuse_an_average_from_outside_the_run():
    from adam_dask.train._settings import RunSettings

    assert RunSettings.resolve().average_from is None  # off by default: the paper has none
    assert RunSettings.resolve(average_from=0.5).average_from == 0.5
    with pytest.raises(ConfigError, match=r"average_from=1\.5"):
        RunSettings.resolve(average_from=1.5)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("avg-data"), n_train=768, n_test=256)


def _recording(trainer: Trainer, seen: list) -> None:
    """Keep a copy of the weights each validation pulls from the parameter server."""
    evaluate = trainer.evaluate

    def wrapped(*a, **kw):
        acc = evaluate(*a, **kw)
        seen.append(trainer.net.flat.copy())
        return acc

    trainer.evaluate = wrapped  # type: ignore[method-assign]


def test_trainer_validates_the_average_and_resumes_it(store, adam_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    kw = dict(lr=0.05, push_every=64, batch_size=8, progress=False)
    seen: list[np.ndarray] = []
    t = Trainer(store, model=SPEC, client=adam_cluster, checkpoint=ckpt, average_from=0.0, **kw)
    _recording(t, seen)
    try:
        t.fit(epochs=4, target_accuracy=0.0)  # stops after the first epoch, part-way
    finally:
        t.close()
    assert [r["averaged_epochs"] for r in t.history] == [1]
    r = Trainer.resume(ckpt, client=adam_cluster, progress=False)
    try:
        assert r.settings.average_from == 0.0  # stored with the run's settings
        assert r.average is not None and r.average.epochs == [0]
        np.testing.assert_allclose(r.average.weights(), seen[0], rtol=1e-6)
        _recording(r, seen)
        r.fit(epochs=4)
        x, y = r.validation.arrays()
        averaged = r.averaged_network()
    finally:
        r.close()
    h = r.history
    assert h.column("averaged_epochs") == [1, 2, 3, 4]
    assert len(seen) == 4
    np.testing.assert_allclose(averaged.flat, np.mean(seen, axis=0), rtol=1e-5, atol=1e-7)
    assert h.last["average_accuracy"] == pytest.approx(averaged.evaluate(x, y))
    # the average is not the last weights: it differs from what the PS ends with
    assert not np.allclose(averaged.flat, seen[-1])
    # the history's plot draws the average's curve beside the weights' own
    import matplotlib

    matplotlib.use("Agg")
    acc_ax = h.plot().axes[1]
    assert [line.get_label() for line in acc_ax.lines] == ["weights", "tail average"]
    np.testing.assert_allclose(
        acc_ax.lines[1].get_ydata(), [100 * a for a in h.column("average_accuracy")]
    )


def test_without_averaging_the_history_has_no_average(store, adam_cluster):
    t = Trainer(store, model=SPEC, client=adam_cluster, lr=0.05, push_every=64, progress=False)
    try:
        t.fit(epochs=1)
        with pytest.raises(ConfigError, match="no weights have been averaged"):
            t.averaged_network()
    finally:
        t.close()
    assert "average_accuracy" not in t.history.last


def test_an_average_that_cannot_be_stored_is_logged_and_training_goes_on(
    store, adam_cluster, tmp_path, caplog
):
    # a plain file where the checkpoint's average array must go: every write of it fails
    ckpt = tmp_path / "ckpt"
    t = Trainer(
        store,
        model=SPEC,
        client=adam_cluster,
        checkpoint=str(ckpt),
        average_from=0.0,
        lr=0.05,
        push_every=64,
        progress=False,
    )
    evaluate = t.evaluate

    def obstructed(*a, **kw):  # the checkpoint exists by now (the PS made it in fit)
        if not (ckpt / "average").exists():
            (ckpt / "average").write_text("in the way")
        return evaluate(*a, **kw)

    t.evaluate = obstructed  # type: ignore[method-assign]
    try:
        with caplog.at_level("WARNING", logger="adam_dask.train.trainer"):
            t.fit(epochs=2)
        averaged = t.averaged_network()  # the mean stayed in memory
        x, y = t.validation.arrays()
    finally:
        t.close()
    warned = [r.getMessage() for r in caplog.records if "weight average" in r.getMessage()]
    assert len(warned) == 2 and "training goes on" in warned[0]
    assert t.history.column("averaged_epochs") == [1, 2]
    assert t.history.last["average_accuracy"] == pytest.approx(averaged.evaluate(x, y))
    assert (ckpt / "average").read_text() == "in the way"
