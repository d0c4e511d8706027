"""ParameterLayout: named views and a shard split that covers the flat buffer exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adam_dask.errors import ConfigError
from adam_dask.model import Network, ParameterLayout


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5000), st.integers(4, 3000))
def test_shards_cover_the_buffer_exactly(size, shard_bytes):
    lay = ParameterLayout([("w", (size,))])
    shards = lay.shards(shard_bytes)
    assert shards[0][0] == 0 and shards[-1][1] == size
    for (a, b), (c, _) in zip(shards, shards[1:]):
        assert b == c
    for a, b in shards:
        assert 0 < b - a <= shard_bytes // 4
    # the fewest shards that fit, as even as they can be
    assert len(shards) == -(-size // (shard_bytes // 4))
    lengths = [b - a for a, b in shards]
    assert max(lengths) - min(lengths) <= 1
    covered = np.zeros(size, np.int64)
    for a, b in shards:
        covered[a:b] += 1
    assert (covered == 1).all()


def test_paper_network_shards_of_one_megabyte():
    net = Network.from_spec()
    shards = net.layout.shards(1 << 20)
    assert len(shards) == 2 and shards[-1][1] == net.flat.size
    assert abs((shards[0][1] - shards[0][0]) - (shards[1][1] - shards[1][0])) <= 1
    assert sum(b - a for a, b in shards) == net.flat.size


def test_views_write_through_and_round_trip():
    lay = ParameterLayout([("0.weight", (3, 2)), ("0.bias", (3,))])
    flat = lay.allocate()
    v = lay.views(flat)
    v["0.bias"][:] = 7
    assert (flat[6:] == 7).all()
    assert ParameterLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    with pytest.raises(ConfigError):
        lay.views(np.zeros(5, np.float32))
    with pytest.raises(ConfigError):
        lay.shards(2)
