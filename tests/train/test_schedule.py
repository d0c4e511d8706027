"""The learning-rate schedule anneals over the planned epochs whatever their number; a run's
settings resolve keyword > stored (a resumed run) > adam.yaml; the epoch's arithmetic."""

from __future__ import annotations

import dask
import pytest

from adam_dask.errors import ClusterError, ConfigError
from adam_dask.train._epoch import quorum_size, replica_count, share_sizes
from adam_dask.train._settings import RunSettings
from adam_dask.train.schedule import KINDS, Schedule
from adam_dask.train.streams import auto_push_every, stream_plan


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


@pytest.mark.parametrize("kind", KINDS)
def test_warmup_ramps_from_the_floor_to_the_shape_then_follows_it(kind):
    plain = Schedule(lr=0.05, epochs=10, kind=kind, floor=0.01)
    warm = Schedule(lr=0.05, epochs=10, kind=kind, floor=0.01, warmup=1.5)
    assert warm.at(0) == pytest.approx(0.05 * 0.01)  # the first push steps at the floor's rate
    ramp = [warm.at(1.5 * i / 50) for i in range(51)]
    assert all(a < b for a, b in zip(ramp, ramp[1:]))  # rises all through the warm-up
    assert all(w < p for w, p in zip(ramp[:-1], (plain.at(1.5 * i / 50) for i in range(50))))
    # it ends on the shape's own rate, and from there on the two schedules are the same
    for e in (1.5, 2.0, 7.25, 10.0, 12.0):
        assert warm.at(e) == pytest.approx(plain.at(e))
    assert Schedule.from_dict(warm.to_dict()) == warm and warm.replan(20).warmup == 1.5


def test_a_manifest_from_before_the_warmup_reads_as_none():
    old = {"lr": 0.05, "epochs": 10, "kind": "cosine", "floor": 0.01}
    assert Schedule.from_dict(old) == Schedule(0.05, 10, "cosine", 0.01, warmup=0.0)


def test_warmup_comes_from_the_config_and_is_kept_by_a_resumed_run():
    with dask.config.set({"adam.train.lr-warmup": 0.5}):
        assert Schedule.from_config(epochs=4).warmup == 0.5
        stored = RunSettings.resolve(lr_warmup=2.0).to_dict()
        assert RunSettings.resolve().lr_warmup == 0.5
    assert RunSettings.resolve(stored).lr_warmup == 2.0
    assert RunSettings.resolve(stored, lr_warmup=0.0).lr_warmup == 0.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="lr_warmup"):
            RunSettings.resolve(lr_warmup=bad)
        with pytest.raises(ConfigError, match="warm-up"):
            Schedule(0.05, 3, "cosine", 0.01, warmup=bad)


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
    assert RunSettings.resolve(batch_size=8, stream_images=70).stream_batch(16) == 64
    # auto: 32 images a thread, at least 64 (2 threads: 64, as before; 8: 256; 16: 512)
    auto = RunSettings.resolve(batch_size=8)
    assert auto.stream_images is None
    assert [auto.stream_batch(t) for t in (1, 2, 4, 8, 16)] == [64, 64, 128, 256, 512]
    with pytest.raises(ConfigError, match="mode"):
        RunSettings.resolve(mode="fast")
    with pytest.raises(ConfigError, match="momentum"):
        RunSettings.resolve(offload_dense=True, momentum=0.9)
    # threads auto: None here, each replica then runs as many threads as its TRAIN worker has
    with dask.config.set({"adam.cluster.trainer-threads": "auto"}):
        assert RunSettings.resolve().threads is None and RunSettings.resolve(threads=3).threads == 3
    with pytest.raises(ConfigError, match="threads=0"):
        RunSettings.resolve(threads=0)


def test_epoch_arithmetic():
    assert [quorum_size(r, 0.75) for r in (1, 2, 3, 4, 8)] == [1, 2, 3, 3, 6]
    assert replica_count(None, 3) == 3  # auto: one per TRAIN worker present
    assert replica_count(2, 3) == 2
    with pytest.raises(ClusterError, match="no TRAIN workers"):
        replica_count(None, 0)
    assert share_sizes(10, 3) == [3, 3, 4] and sum(share_sizes(60000, 7)) == 60000
    s = Schedule(0.05, 10, "cosine", 0.01, warmup=1.0)
    for e in (0.0, 0.5, 3.0, 10.0):
        assert s.scaled(0.25).at(e) == pytest.approx(0.25 * s.at(e))
    with pytest.raises(ConfigError, match="lr_replicas=0"):
        RunSettings.resolve(lr_replicas=0)


def _plan(mode="async", replicas=1, threads=1, **kw):
    given = {"push_every": None, "lr_streams": 8, "lr_replicas": None, "lr_warmup": None}
    return stream_plan(mode, replicas, threads, **{**given, **kw})


def test_many_streams_share_the_rate_push_more_often_and_warm_up():
    """The defaults for R replicas x T threads (streams.py): each of a replica's T threads at
    the full rate up to lr_streams, lr_streams / T past it, times sqrt(2 / R) past 2
    replicas; a push period that shrinks with R**2 (512 for one replica, 32 from 8); a
    half-epoch warm-up past 2 streams."""
    assert [auto_push_every(r) for r in (1, 2, 4, 8, 16, 64)] == [512, 256, 64, 32, 32, 32]
    factors = [_plan(replicas=r).rate_factor for r in (1, 2, 4, 8)]
    assert factors == pytest.approx([1, 1, 0.5**0.5, 0.5])  # past 2 replicas, sqrt(2 / R)
    assert _plan(replicas=8, threads=2).rate_factor == 0.5
    assert _plan(replicas=4, threads=4).rate_factor == pytest.approx(0.5**0.5)
    assert _plan(replicas=1, threads=16).rate_factor == 0.5
    assert _plan(replicas=2, threads=8).rate_factor == 1.0
    assert _plan(replicas=2, threads=16).rate_factor == 0.5
    assert _plan(replicas=16, threads=4).rate_factor == pytest.approx((2 / 16) ** 0.5)
    # one replica of up to 2 threads (a 2-core machine's default) trains as it always did
    one = _plan(replicas=1, threads=2)
    assert (one.rate_factor, one.push_every, one.warmup) == (1.0, 512, 0.0)
    assert _plan(replicas=2).warmup == 0.0 and _plan(replicas=2, threads=2).warmup == 0.5
    # what a user gives wins, and a push period above the auto one damps the rate
    given = _plan(replicas=8, push_every=128, lr_warmup=0.0)
    assert (given.push_every, given.warmup, given.damped) == (128, 0.0, True)
    assert given.rate_factor == pytest.approx(0.5 * 32 / 128)
    assert not _plan(replicas=8, push_every=16).damped
    assert _plan(replicas=8, lr_streams=None).rate_factor == 1.0  # off: the rate as given
    # lr_replicas keeps the older rule: lr * lr_replicas / R per replica, no damping
    old = _plan(replicas=4, threads=2, lr_replicas=2, push_every=512)
    assert (old.rate_factor, old.damped) == (0.5, False)
    # replica momentum was not swept: the older rule, lr / R, no thread share
    mom = _plan(replicas=2, threads=2, momentum=0.9)
    assert (mom.rate_factor, mom.push_every) == (0.5, 256)
    # synchronous replicas average their deltas: the rate as given, a step every auto-push.max
    sync = _plan("sync", replicas=8)
    assert (sync.rate_factor, sync.push_every, sync.warmup) == (1.0, 512, 0.0)


def test_auto_settings_resolve_and_bad_ones_are_refused():
    s = RunSettings.resolve()
    assert s.push_every is None and s.lr_warmup is None and s.lr_streams == 8
    assert RunSettings.resolve(push_every=64, lr_warmup=0.0).push_every == 64
    with pytest.raises(ConfigError, match="lr_streams=0"):
        RunSettings.resolve(lr_streams=0)
    with pytest.raises(ConfigError, match="push_every=0"):
        RunSettings.resolve(push_every=0)
