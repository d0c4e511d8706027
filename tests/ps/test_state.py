"""ShardState: the pure shard logic (no Dask)."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.errors import UpdateRejected
from adam_dask.ps.protocol.outer import outer_part
from adam_dask.ps.protocol.shard import ShardState
from adam_dask.ps.protocol.shard_kernels import first_nonfinite, scan_delta


def test_apply_sums_and_versions():
    st = ShardState(0, 100, 1100)
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]
    assert st.apply(deltas[0]) == 1
    assert st.apply_batch(deltas[1:]) == [2, 3, 4, 5]
    np.testing.assert_allclose(st.values, np.sum(deltas, axis=0), rtol=1e-5, atol=1e-5)
    assert st.version == 5 and st.pushes_applied == 5


def test_a_none_delta_is_recorded_without_adding():
    st = ShardState(0, 0, 10, np.ones(10, np.float32))
    assert st.apply_batch([None, np.full(10, 2, np.float32), None], [7, 8, 9]) == [1, 2, 3]
    np.testing.assert_array_equal(st.values, np.full(10, 3, np.float32))
    assert st.version == 3 and st.pushes_applied == 3
    assert st.apply(None, push_id=7) == 1 and st.version == 3  # a repeated id: applied once
    assert st.check(None) is None


def test_blocked_batch_equals_numpy_across_blocks():
    n = 3 * 4096 + 17
    rng = np.random.default_rng(1)
    st = ShardState(3, 0, n, rng.standard_normal(n).astype(np.float32))
    ref = st.values.copy()
    deltas = [rng.standard_normal(n).astype(np.float32) for _ in range(7)]
    st.apply_batch(deltas)
    for d in deltas:
        ref += d
    np.testing.assert_array_equal(st.values, ref)  # same order of float additions per element


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_refused_unchanged(bad):
    st = ShardState(2, 0, 50, np.arange(50, dtype=np.float32))
    before = st.values.copy()
    good = np.ones(50, np.float32)
    d = np.ones(50, np.float32)
    d[31] = bad
    with pytest.raises(UpdateRejected) as e:
        st.apply_batch([good, d])
    assert e.value.shard == 2 and "index 31" in str(e.value)
    np.testing.assert_array_equal(st.values, before)
    assert st.version == 0


def test_wrong_length_refused():
    st = ShardState(0, 0, 10)
    with pytest.raises(UpdateRejected):
        st.apply(np.ones(9, np.float32))


def test_retried_push_applies_once():
    st = ShardState(0, 0, 4)
    assert st.apply(np.ones(4, np.float32), push_id=77) == 1
    assert st.apply(np.ones(4, np.float32), push_id=77) == 1
    np.testing.assert_array_equal(st.values, np.ones(4))
    assert st.seen(77) and not st.seen(78)


def test_snapshot_install_carries_ids():
    primary, backup = ShardState(0, 0, 8), ShardState(0, 0, 8)
    primary.apply(np.full(8, 2, np.float32), push_id=1)
    snap = primary.snapshot(since=-1)
    primary.apply(np.full(8, 3, np.float32), push_id=2)  # the snapshot is a copy
    assert backup.install(snap.version, snap.values, snap.ids)
    assert not backup.install(snap.version, snap.values, snap.ids)  # not newer
    np.testing.assert_array_equal(backup.values, np.full(8, 2))
    assert backup.version == 1 and backup.seen(1)
    # promoted backup: a retried push 1 is not applied again, push 2 is
    backup.apply(np.full(8, 2, np.float32), push_id=1)
    backup.apply(np.full(8, 3, np.float32), push_id=2)
    np.testing.assert_array_equal(backup.values, primary.values)
    assert primary.ids_since(1) == ((2, 2),)


@pytest.mark.parametrize("start,stop", [(0, 1000), (30, 170), (100, 123), (1000, 2000)])
def test_outer_product_parts(start, stop):
    rng = np.random.default_rng(2)
    B, out, inp, offset = 4, 7, 13, 20
    err = rng.standard_normal((B, out)).astype(np.float32)
    act = rng.standard_normal((B, inp)).astype(np.float32)
    full = np.zeros(2000, np.float32)
    full[offset : offset + out * inp] = (0.5 * err.T @ act).reshape(-1)
    st = ShardState(0, start, stop)
    part = outer_part(offset, out, inp, start, stop)
    cols = err if part is None else err[:, part.row0 : part.row1]
    st.apply_outer(offset, out, inp, cols, act, 0.5)
    np.testing.assert_allclose(st.values, full[start:stop], rtol=1e-5, atol=1e-6)


def test_outer_nonfinite_refused():
    st = ShardState(0, 0, 20)
    err = np.ones((2, 4), np.float32)
    err[1, 1] = np.nan
    with pytest.raises(UpdateRejected):
        st.apply_outer(0, 4, 5, err, np.ones((2, 5), np.float32))
    assert st.version == 0 and not st.values.any()


def test_first_nonfinite():
    x = np.zeros((3, 4), np.float32)
    assert first_nonfinite(x) == -1
    x[2, 1] = np.inf
    assert first_nonfinite(x) == 9


@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_the_scan_matches_numpy(bad):
    """The pusher's one check against numpy: the first non-finite index, and which shards
    hold a non-zero value."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32)
    bounds = np.array([[0, 300], [300, 600], [600, 900], [900, 1000]], np.int64)
    x[300:600] = 0  # an all-zero shard
    x[950] = -0.0  # zero too: the last shard still holds non-zeros elsewhere
    if bad is not None:
        x[[700, 710]] = bad
    want_bad = int(np.flatnonzero(~np.isfinite(x))[0]) if bad is not None else -1
    got, nonzero = scan_delta(x, bounds)
    assert got == want_bad
    if bad is None:
        np.testing.assert_array_equal(nonzero, [x[a:b].any() for a, b in bounds])
