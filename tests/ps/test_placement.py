"""The placement policy (pure functions of the scheduler plugin)."""

from __future__ import annotations

from collections import Counter

import pytest

from adam_dask.errors import ClusterError
from adam_dask.ps.placement import (
    PlacementWarning,
    choose_new_holder,
    choose_primary,
    plan_placement,
)


def workers(n, hosts=None):
    hosts = hosts or n
    return {f"tcp://10.0.0.{i % hosts}:{4000 + i}": f"10.0.0.{i % hosts}" for i in range(n)}


@pytest.mark.parametrize("n_workers,n_shards", [(3, 3), (3, 10), (5, 7), (8, 40)])
def test_distinct_hosts_and_balanced_primaries(n_workers, n_shards):
    w = workers(n_workers)
    plan = plan_placement(n_shards, w, 3)
    for holders in plan.values():
        assert len(holders) == 3
        assert len({w[a] for a in holders}) == 3
    prim = Counter(h[0] for h in plan.values())
    assert max(prim.values()) - min(prim.get(a, 0) for a in w) <= 1
    total = Counter(a for h in plan.values() for a in h)
    assert max(total.values()) - min(total.get(a, 0) for a in w) <= 2


def test_too_few_hosts_distinct_workers_with_warning():
    w = workers(4, hosts=2)
    with pytest.warns(PlacementWarning, match="distinct PS hosts"):
        plan = plan_placement(6, w, 3)
    for holders in plan.values():
        assert len(set(holders)) == 3
        assert len({w[a] for a in holders}) == 2  # both hosts used


def test_too_few_workers_warns_and_keeps_fewer():
    with pytest.warns(PlacementWarning):
        plan = plan_placement(2, workers(2), 3)
    assert all(len(h) == 2 for h in plan.values())


def test_no_workers():
    with pytest.raises(ClusterError):
        plan_placement(1, {}, 3)


def test_new_holder_prefers_unused_host_then_load():
    w = {"a": "h1", "b": "h2", "c": "h1", "d": "h3", "e": "h3"}
    assert choose_new_holder(["a", "b"], w, Counter({"d": 2, "e": 1})) == "e"
    assert choose_new_holder(["a", "b", "d"], w, Counter()) == "c"  # no free host: distinct worker
    assert choose_new_holder(list(w), w, Counter()) is None
    # among hosts the shard does not use, a worker that holds a node already comes first
    assert choose_new_holder(["a", "b"], w, Counter({"d": 5}), ready={"d"}) == "d"
    assert choose_new_holder([], w, Counter(), ready={"e"}) == "e"  # a restore: no wait


def test_choose_primary_newest_version():
    assert choose_primary({"a": 4, "b": 7, "c": 7}, Counter({"b": 2})) == "c"
