"""Ranged pushes and pulls (a partition of a model replica holds one span of the parameters):
only the shards that overlap the span are touched, the sums are exact, a straddled shard keeps
its values outside the span, and the mark names its target shards, applied once per part."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.errors import ConfigError, UpdateRejected
from adam_dask.ps.protocol.shard import Mark
from adam_dask.train._position import applied_images

N, SHARD = 6000, 4000  # 6 shards of 1000 floats


def test_ranged_pushes_touch_only_their_shards_and_sum_exactly(make_server):
    s = make_server(size=N, shard_bytes=SHARD)
    assert len(s.shards) == 6
    rng = np.random.default_rng(0)
    total = np.zeros(N, np.float32)
    spans = [(0, 2500), (2500, 6000)]  # shard 2 ([2000, 3000)) straddles the edge
    for seq in range(3):
        for part, (a, b) in enumerate(spans):
            d = rng.integers(-4, 5, b - a).astype(np.float32)
            mark = Mark(0, 0, seq, part, 2, 1, [[0, seq, 0, 10]])
            s.push_range(d, a, mark=mark)
            total[a:b] += d
    s.flush()
    np.testing.assert_array_equal(s.pull(), total)
    np.testing.assert_array_equal(s.pull_range(1500, 3500), total[1500:3500])
    out = np.full(2500, -1, np.float32)
    assert s.pull_range(0, 2500, out=out) is out
    np.testing.assert_array_equal(out, total[:2500])
    marks = s.marks(0)
    # shard 0 holds only part 0's marks, shard 5 only part 1's, shard 2 both, with targets
    assert {m.part for m in marks[0][0]} == {0} and {m.part for m in marks[5][0]} == {1}
    assert {m.part for m in marks[2][0]} == {0, 1}
    assert next(m for m in marks[5][0]).targets == (2, 3, 4, 5)
    assert applied_images(marks) == 30  # three complete pushes of 10 images
    # a part pushed again under its number is fenced: applied once
    s.push_range(np.ones(3500, np.float32), 2500, mark=Mark(0, 0, 1, 1, 2, 1, [[0, 1, 0, 10]]))
    s.flush()
    np.testing.assert_array_equal(s.pull(), total)


def test_a_part_missing_from_a_push_does_not_count_its_images(make_server):
    s = make_server(size=N, shard_bytes=SHARD)
    s.push_range(np.ones(2500, np.float32), 0, mark=Mark(1, 0, 0, 0, 2, 1, [[0, 0, 0, 8]]))
    s.flush()
    assert applied_images(s.marks(1)) == 0  # part 1 of push 0 never came
    s.push_range(np.ones(3500, np.float32), 2500, mark=Mark(1, 0, 0, 1, 2, 1, [[0, 0, 0, 8]]))
    s.flush()
    assert applied_images(s.marks(1)) == 8


def test_bad_ranges_and_values_are_refused(make_server):
    s = make_server(size=N, shard_bytes=SHARD)
    with pytest.raises(ConfigError, match="not inside"):
        s.push_range(np.ones(10, np.float32), N - 5)
    bad = np.ones(100, np.float32)
    bad[7] = np.nan
    with pytest.raises(UpdateRejected, match="flat index 1007"):
        s.push_range(bad, 1000)
    np.testing.assert_array_equal(s.pull(), np.zeros(N, np.float32))


@pytest.mark.parametrize("plane", ["auto", "tcp", "dask"])
def test_a_ranged_push_with_its_pull_reads_the_span_after_the_push(make_server, plane):
    """A partition's exchange in one call: the span it pushed to, read back after the push
    (with the other part's pushes in it), on every transport; nothing outside the span."""
    import dask

    with dask.config.set({"adam.ps.data-plane": plane}):
        s = make_server(size=N, shard_bytes=SHARD)
    rng = np.random.default_rng(1)
    total = np.zeros(N, np.float32)
    spans = [(0, 2500), (2500, 6000)]  # shard 2 straddles the edge
    for seq in range(3):
        for part, (a, b) in enumerate(spans):
            d = rng.integers(-4, 5, b - a).astype(np.float32)
            out = np.full(b - a, -7, np.float32)
            mark = Mark(0, 0, seq, part, 2, 1, [[0, seq, 0, 10]])
            assert s.push_range(d, a, mark=mark, out=out) is out
            total[a:b] += d
            np.testing.assert_array_equal(out, total[a:b])
    assert applied_images(s.marks(0)) == 30
    counts = s.stats()["data_plane"]
    s.flush()
    np.testing.assert_array_equal(s.pull(), total)
    if plane != "dask":  # on the plane each exchange is its pushes, no pull of their own
        assert counts["pushes"] >= 6 and counts["pulls"] == 0, counts
