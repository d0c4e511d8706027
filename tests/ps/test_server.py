"""ParameterServer on a real embedded cluster: placement, exact sums, outer products, rejection,
use from worker tasks, checkpoint and restore."""

from __future__ import annotations

import io
import json
import pickle
import threading
import time
from pathlib import Path

import dask
import numpy as np
import pytest
from distributed import get_worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adam_dask.cluster import workers_with_role
from adam_dask.errors import CheckpointError, UpdateRejected
from adam_dask.model.layout import ParameterLayout
from adam_dask.ps import ParameterServer
from adam_dask.ps.protocol.request import Request

SHARD = 1 << 16  # 16 Ki floats per shard keeps the tests quick
N = 5 * (SHARD // 4) + 123  # 6 shards


def host(addr: str) -> str:
    return addr.split("://")[1].rsplit(":", 1)[0]


def test_placement_distinct_hosts_balanced(ps_client, make_server):
    s = make_server(size=N, shard_bytes=SHARD, replicas=3)
    pl = s.placement()
    ps = set(workers_with_role(ps_client, "PS"))
    assert sorted(pl) == list(range(6))
    for holders in pl.values():
        assert len(holders) == 3 and set(holders) <= ps
        assert len({host(a) for a in holders}) == 3
    primaries = [h[0] for h in pl.values()]
    assert sorted(primaries.count(a) for a in ps) == [2, 2, 2]


def test_pushes_sum_exactly(make_server, tmp_path):
    s = make_server(size=N, shard_bytes=SHARD, checkpoint=str(tmp_path / "ck"))
    rng = np.random.default_rng(0)
    total = np.zeros(N, np.float32)
    for i in range(8):
        d = rng.integers(-4, 5, N).astype(np.float32)  # small integers: float sums are exact
        a, b = s.shards[i % 6]
        d[a:b] = 0  # one shard's part all zeros: sent as None
        s.push(d)
        total += d
    versions = s.flush()
    np.testing.assert_array_equal(s.pull(), total)
    assert set(versions.values()) == {8}
    stats = s.stats()
    assert stats["pushes_applied"] == 8 * 6
    assert stats["max_replication_lag"] == 0 and stats["writeback_lag_versions"] == 0
    # every backup holds the same values (read straight from the nodes)
    for node in stats["nodes"].values():
        assert set(node["versions"].values()) == {8}


def test_init_pull_some_shards_and_layout_meta(make_server):
    lay = ParameterLayout([("0.weight", (100, 50)), ("0.bias", (100,)), ("1.weight", (10, 100))])
    init = np.arange(lay.size, dtype=np.float32)
    s = make_server(layout=lay, shard_bytes=4096, init=init, meta={"spec": "fc100,fc10"})
    assert s.size == lay.size and len(s.shards) == -(-lay.size // 1024)
    np.testing.assert_array_equal(s.pull(), init)
    out = np.full(lay.size, -1, np.float32)
    s.pull(shards=[1, 3], out=out)
    (a0, b0), (a1, b1), (a2, b2), (a3, b3) = s.shards[:4]
    np.testing.assert_array_equal(out[a1:b1], init[a1:b1])
    np.testing.assert_array_equal(out[a3:b3], init[a3:b3])
    assert (out[a0:b0] == -1).all() and (out[a2:b2] == -1).all()


def test_push_outer_equals_explicit_delta(make_server):
    out_, inp, offset, B = 300, 70, 1000, 16  # 21000 floats spanning shards 0..5 of 4096 B
    s = make_server(size=30_000, shard_bytes=4096, ack="all")
    rng = np.random.default_rng(3)
    err = rng.standard_normal((B, out_)).astype(np.float32)
    act = rng.standard_normal((B, inp)).astype(np.float32)
    s.push_outer(offset, err, act, scale=-0.1)
    expected = np.zeros(30_000, np.float32)
    expected[offset : offset + out_ * inp] = (-0.1 * (err.T @ act)).reshape(-1)
    np.testing.assert_allclose(s.pull(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(UpdateRejected):
        s.push_outer(29_000, err, act)  # does not fit
    # no checkpoint: nothing is written back, so nothing is reported as lagging behind
    stats = s.stats()
    assert stats["writeback_lag_versions"] == 0 and stats["writeback_lag_seconds"] == 0.0


def test_nan_push_refused_shard_unchanged(make_server):
    s = make_server(size=N, shard_bytes=SHARD)
    s.push(np.ones(N, np.float32))
    before = s.pull()
    d = np.ones(N, np.float32)
    d[s.shards[2][0] + 5] = np.nan
    with pytest.raises(UpdateRejected) as e:
        s.push(d)
    assert e.value.shard == 2
    d[s.shards[2][0] + 5] = np.inf
    with pytest.raises(UpdateRejected):
        s.push(d)
    np.testing.assert_array_equal(s.pull(), before)
    # the node refuses too, even when the client check is bypassed (a request sent straight
    # through the courier as an actor call, the path that checks on the node): the shard is
    # unchanged (the client's own check is what makes a multi-shard push all-or-nothing)
    bad = np.ones(N, np.float32)
    bad[7] = np.nan
    req = Request("push", tuple(range(len(s.shards))), 12345, "replay", values=bad)
    with pytest.raises(UpdateRejected) as e, dask.config.set({"adam.ps.data-plane": "dask"}):
        s._courier.deliver(req)
    assert e.value.shard == 0
    per = s.shards[0][1]
    np.testing.assert_array_equal(s.pull()[:per], before[:per])
    assert s.versions()[0] == 1


def _push_from_task(server, seed, n):
    rng = np.random.default_rng(seed)
    total = np.zeros(server.size, np.float32)
    for _ in range(n):
        d = rng.integers(-3, 4, server.size).astype(np.float32)
        server.push(d)
        total += d
    return get_worker().address, total, server.pull()[:4]


def test_pickled_server_in_tasks_on_train_worker(ps_client, make_server):
    s = make_server(size=N, shard_bytes=SHARD)
    futs = [
        ps_client.submit(_push_from_task, s, i, 5, resources={"TRAIN": 1}, pure=False)
        for i in range(2)
    ]
    results = ps_client.gather(futs)
    train = set(workers_with_role(ps_client, "TRAIN"))
    assert {addr for addr, _, _ in results} <= train
    np.testing.assert_array_equal(s.pull(), results[0][1] + results[1][1])


class _ShipsNoItertools(pickle.Pickler):
    """Pickles as a client ships an object, refusing an itertools iterator: Python 3.12 warns on
    pickling one (an error where warnings are) and 3.14 refuses."""

    def reducer_override(self, obj):
        if type(obj).__module__ == "itertools":
            raise AssertionError(f"an itertools.{type(obj).__name__} would be shipped")
        return NotImplemented


def test_what_a_client_ships_pickles_on_every_python(ps_client, make_server):
    """The controller plugin and the worker plugins a server's creation registers, and the
    handle each replica's task gets, pickle without an itertools iterator in them."""
    from adam_dask._worker_preload import RedactLogs, TaskProfiler
    from adam_dask.ps.runtime.plugin import ShardPlacement

    s = make_server(size=N, shard_bytes=SHARD)
    s.push(np.ones(N, np.float32))  # the handle's connections and log exist
    for obj in (ShardPlacement(), RedactLogs(), TaskProfiler(), s):
        _ShipsNoItertools(io.BytesIO()).dump(obj)


def test_attach_by_name(ps_client, make_server):
    s = make_server(size=1000, shard_bytes=1024, name="attach-me")
    s.push(np.full(1000, 2, np.float32))
    other = ParameterServer.attach(ps_client, "attach-me")
    np.testing.assert_array_equal(other.pull(), np.full(1000, 2))
    assert other.placement() == s.placement()


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.lists(st.integers(-3, 3), min_size=1, max_size=6), min_size=2, max_size=4),
    st.integers(0, 2**31),
)
def test_any_interleaving_sums_the_same(make_server_module, per_client, seed):
    """Several clients (threads) push concurrently in any order: the result is the sum."""
    s = make_server_module
    start = s.pull()
    rng = np.random.default_rng(seed)
    deltas = [
        [(v * rng.integers(0, 2, s.size)).astype(np.float32) for v in seq] for seq in per_client
    ]
    barrier = threading.Barrier(len(deltas))
    errors = []

    def run(seq, jitter):
        try:
            barrier.wait()
            for i, d in enumerate(seq):
                if jitter[i]:
                    time.sleep(0.001 * jitter[i])
                s.push(d)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(seq, rng.integers(0, 3, len(seq)))) for seq in deltas
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    expected = start + sum(d for seq in deltas for d in seq)
    np.testing.assert_array_equal(s.pull(), expected)


@pytest.fixture(scope="module")
def make_server_module(ps_client):
    s = ParameterServer.create(ps_client, size=20_000, shard_bytes=16384)
    yield s
    s.close()


# -- checkpoint ---------------------------------------------------------------------------------


def test_checkpoint_restore_equals_flush(ps_client, make_server, tmp_path):
    url = "file://" + str(tmp_path / "ckpt")
    lay = ParameterLayout([("w", (N - 10,)), ("b", (10,))])
    s = make_server(layout=lay, shard_bytes=SHARD, checkpoint=url, meta={"spec": "x"})
    rng = np.random.default_rng(5)
    for _ in range(3):
        s.push(rng.standard_normal(N).astype(np.float32))
    s.flush(epoch=2)
    at_flush = s.pull()
    m = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert m["epoch"] == 2 and m["versions"] == [3] * 6 and m["meta"] == {"spec": "x"}
    s.close()
    r = ParameterServer.restore(ps_client, url)
    try:
        np.testing.assert_array_equal(r.pull(), at_flush)
        assert r.meta == {"spec": "x"} and r.epoch == 2 and r.layout == lay
        assert r.versions() == {i: 3 for i in range(6)}
        r.push(np.ones(N, np.float32))  # the restored server keeps writing back to the same URL
        r.flush(epoch=3)
        m = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
        assert m["epoch"] == 3 and m["versions"] == [4] * 6
    finally:
        r.close()


def test_restore_missing_checkpoint(ps_client, tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ParameterServer.restore(ps_client, str(tmp_path / "nothing"))


def test_writeback_without_flush_and_manifest_never_ahead_of_data(make_server, tmp_path):
    """Every push adds 1 everywhere, so version v means every value is v. A reader polling the
    checkpoint while pushes go on must never see a manifest version above the data's, a block
    the manifest names missing, or a manifest going back."""
    import dask
    import zarr

    url = str(tmp_path / "ck2")
    with dask.config.set({"adam.ps.writeback-interval": 0.05}):
        s = make_server(size=N, shard_bytes=SHARD, checkpoint=url)
    stop = threading.Event()
    seen = []
    problems = []

    def reader():
        mpath = Path(url) / "manifest.json"
        last = (-1, [-1] * 6)
        while not stop.is_set():
            try:
                m = json.loads(mpath.read_text())
            except (FileNotFoundError, ValueError):
                problems.append("manifest missing or torn")
                continue
            if m["sequence"] < last[0] or any(
                v < w for v, w in zip(m["versions"], last[1], strict=True)
            ):
                problems.append(f"the manifest went back: {last} -> {m['versions']}")
            last = (m["sequence"], m["versions"])
            for sid, (a, b) in enumerate(m["shards"]):
                try:
                    chunk = zarr.open_array(url, path=m["blocks"][sid], mode="r")[:]
                except FileNotFoundError:
                    latest = json.loads(mpath.read_text())
                    if latest["blocks"][sid] == m["blocks"][sid]:
                        problems.append(f"the manifest names {m['blocks'][sid]}: not there")
                    continue  # replaced and collected since this manifest was read
                v = m["versions"][sid]
                if chunk.shape != (b - a,) or chunk.min() != chunk.max():
                    problems.append(f"torn shard {sid}")
                if chunk[0] < v:
                    problems.append(f"shard {sid}: manifest {v}, data {chunk[0]}")
                seen.append(v)
            time.sleep(0.01)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(40):
            s.push(np.ones(N, np.float32))
            time.sleep(0.01)
        # no flush: the periodic write-back alone must catch up
        deadline = time.time() + 30
        while time.time() < deadline:
            m = json.loads((Path(url) / "manifest.json").read_text())
            if m["versions"] == [40] * 6:
                break
            time.sleep(0.2)
    finally:
        stop.set()
        t.join()
    assert not problems, problems[:5]
    assert m["versions"] == [40] * 6
    assert max(seen) > 0
