"""The learning-rate schedule anneals over the planned epochs whatever their number; a run's
settings resolve keyword > stored (a resumed run) > adam.yaml; the epoch's arithmetic."""

from __future__ import annotations

import dask
import pytest

from adam_dask.errors import ClusterError, ConfigError
from adam_dask.train._epoch import quorum_size, replica_count, share_sizes
from adam_dask.train._settings import RunSettings
from adam_dask.train.schedule import KINDS, Schedule


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "constant"])
@pytest.mark.parametrize("epochs", [1, 5, 50])
def test_every_plan_anneals_fully_to_the_floor(kind, epochs):
    s = Schedule(lr=0.05, epochs=epochs, kind=kind, floor=0.01)
    rates = [s.at(epochs * i / 100) for i in range(101)]
    assert rates[0] == pytest.approx(0.05) and rates[-1] == pytest.approx(0.0005)
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # never rises
    assert s.at(2 * epochs) == pytest.approx(0.0005)  # past the plan: the floor
    # the same fraction of any plan has the same rate: the schedule is relative to the plan
    assert s.at(epochs / 2) == pytest.approx(s.replan(7).at(3.5))


def test_exponential_is_a_constant_factor_per_epoch_and_constant_stays():
    s = Schedule(lr=0.1, epochs=4, kind="exponential", floor=0.01)
    assert [round(s.at(e + 1) / s.at(e), 6) for e in range(4)] == [round(0.01**0.25, 6)] * 4
    assert Schedule(0.1, 4, "constant", 0.0).at(3.9) == 0.1
    assert Schedule.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"lr": 0.0}, "lr=0.0"),
        ({"epochs": 0}, "epochs=0"),
        ({"kind": "step"}, "not one of"),
        ({"floor": 1.5}, "floor"),
        ({"kind": "exponential", "floor": 0.0}, "floor"),
    ],
)
def test_bad_schedules_are_refused(kw, words):
    args = {"lr": 0.1, "epochs": 3, "kind": "cosine", "floor": 0.0, **kw}
    with pytest.raises(ConfigError, match=words):
        Schedule(**args)


def test_settings_keyword_over_stored_over_config():
    with dask.config.set({"adam.train.lr": 0.03, "adam.train.lr-schedule": "linear"}):
        s = RunSettings.resolve()
        assert s.lr == 0.03 and s.lr_schedule == "linear"
        stored = RunSettings.resolve(mode="sync", lr=0.07).to_dict()
        resumed = RunSettings.resolve(stored, mode=None, push_every=32)
    assert resumed.mode == "sync" and resumed.lr == 0.07 and resumed.push_every == 32
    assert resumed.epoch_quorum == 1.0  # every replica finishes every synchronous step
    assert RunSettings.resolve(batch_size=8, stream_images=70).stream_batch == 64
    with pytest.raises(ConfigError, match="mode"):
        RunSettings.resolve(mode="fast")
    with pytest.raises(ConfigError, match="momentum"):
        RunSettings.resolve(offload_dense=True, momentum=0.9)


def test_epoch_arithmetic():
    assert [quorum_size(r, 0.75) for r in (1, 2, 3, 4, 8)] == [1, 2, 3, 3, 6]
    assert replica_count(None, 3) == 3  # auto: one per TRAIN worker present
    assert replica_count(2, 3) == 2
    with pytest.raises(ClusterError, match="no TRAIN workers"):
        replica_count(None, 0)
    assert share_sizes(10, 3) == [3, 3, 4] and sum(share_sizes(60000, 7)) == 60000
