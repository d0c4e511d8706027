"""One data path: after a fit of every kind the paper moves (the dense offload's activations and
errors, a replica partitioned over two workers, the synchronous baseline, pushes past the replay
log's byte budget), every push and pull the PS nodes served came over the data plane and none
as a Dask actor call (``stats()["nodes"][addr]["by_transport"]``), and every image was applied
once."""

from __future__ import annotations

import dask
import pytest

from adam_dask.testing import synthetic_store
from adam_dask.train.trainer import Trainer

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
N_TRAIN = 768


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("path-data"), n_train=N_TRAIN, n_test=256)


def transports(server) -> dict:
    """Pushes and pulls the live nodes served, summed by transport."""
    nodes = [n for n in server.stats()["nodes"].values() if isinstance(n, dict)]
    return {k: sum(n["by_transport"][k] for n in nodes) for k in ("plane", "dask")}


KINDS = {
    "offload": {"model": "conv5x5:6,maxpool2,fc256,fc10", "offload_dense": True},
    "partitions": {"partitions": 2, "checkpoint": False, "shard_bytes": 4096},
    "sync": {"mode": "sync"},
    # the model's 112 KB pushes, each over the 64 KiB budget: they wait for room, on the plane
    "over-budget": {"config": {"adam.ps.replay-bytes": 65536}},
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_of_fit_moves_its_data_on_the_plane_alone(store, adam_cluster, kind):
    kw = dict(KINDS[kind])
    settings = kw.pop("config", {})
    kw.setdefault("model", SPEC)
    with dask.config.set(settings):
        t = Trainer(
            store,
            client=adam_cluster,
            lr=0.05,
            push_every=64,
            batch_size=8,
            progress=False,
            **kw,
        )
        try:
            hist = t.fit(epochs=1)
            moved = transports(t.server)
        finally:
            t.close()
    assert hist.column("images_applied") == [N_TRAIN], hist.records
    assert moved["plane"] > 0 and moved["dask"] == 0, moved


@pytest.mark.timeout(600)
def test_a_staleness_fit_over_dask_names_the_versions_read_as_on_the_plane(
    store, adam_cluster, monkeypatch
):
    """``adam.ps.data-plane: dask`` (a firewall between pusher and node): a fit with
    ``nesterov+staleness`` sends every push and pull as a Dask actor call, and the pushes name
    the versions their replica read (``bases``: the server optimizer's staleness) as they do on
    the plane; the same fit on the plane for comparison."""
    import adam_dask

    def fit(client) -> tuple[dict, int]:
        t = Trainer(store, client=client, lr=0.05, push_every=64, batch_size=8, model=SPEC,
                    progress=False, server_optimizer="nesterov+staleness")  # fmt: skip
        try:
            hist = t.fit(epochs=1)
            nodes = [n for n in t.server.stats()["nodes"].values() if isinstance(n, dict)]
            based = sum(n["pushes_with_bases"] for n in nodes)
            moved = transports(t.server)
        finally:
            t.close()
        assert hist.column("images_applied") == [N_TRAIN], hist.records
        return moved, based

    on_plane, based_on_plane = fit(adam_cluster)
    assert on_plane["dask"] == 0 and based_on_plane > 0
    monkeypatch.setenv("DASK_ADAM__PS__DATA_PLANE", "dask")  # the workers' setting
    with (
        dask.config.set({"adam.ps.data-plane": "dask"}),
        adam_dask.cluster.local(
            ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
        ) as client,
    ):
        over_dask, based_over_dask = fit(client)
    assert over_dask["plane"] == 0 and over_dask["dask"] > 0, over_dask
    assert based_over_dask > 0
