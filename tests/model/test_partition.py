"""The partition plan (pure): balanced consecutive stages, a dense layer too wide for a fair
share split by output neurons, spans that tile the flat layout, and the memory check that
names the partition over its worker's budget."""

from __future__ import annotations

import pytest

from adam_dask.errors import PartitionError
from adam_dask.model import Network
from adam_dask.model.partition import BASE_BYTES, plan_partitions
from adam_dask.model.stage import stages_of

MNIST = "conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc400,fc400,fc10"


def _net(spec, shape=(1, 28, 28)):
    return Network(spec, shape)


def test_layers_are_cut_into_consecutive_runs_that_balance_the_parameters():
    net = _net(MNIST)
    plan = plan_partitions(net, 2, threads=2, batch_size=8)
    assert plan.bounds() == [(0, 5, 0, 0), (5, 7, 0, 0)]
    sizes = [p.params for p in plan.partitions]
    assert sum(sizes) == net.layout.size and max(sizes) < 0.6 * net.layout.size
    # the spans tile the flat layout, and each equals its stage's
    stages = stages_of(net, plan.bounds())
    assert [(p.start, p.stop_param) for p in plan.partitions] == [(s.start, s.stop) for s in stages]
    assert plan.cross_bytes_per_image() == 2 * 4 * 400  # 400 activations forward, errors back


def test_a_dense_layer_too_wide_for_a_fair_share_is_split_by_output_neurons():
    net = _net("fc4000,fc10")
    assert plan_partitions(net, 2, threads=1, batch_size=8).bounds() == [
        (0, 1, 0, 0),
        (1, 2, 0, 0),
    ]
    plan = plan_partitions(net, 4, threads=1, batch_size=8)
    assert plan.bounds() == [(0, 1, 0, 1333), (0, 1, 1333, 2666), (0, 1, 2666, 4000), (1, 2, 0, 0)]
    stages = stages_of(net, plan.bounds())
    assert [(p.start, p.stop_param) for p in plan.partitions] == [(s.start, s.stop) for s in stages]
    assert max(p.params for p in plan.partitions) < 0.34 * net.layout.size
    assert "fc4000[1333:2666]" in plan.describe()


def test_memory_counts_weights_accumulators_buffers_and_the_process():
    net = _net("fc1000,fc10")
    one = plan_partitions(net, 1, threads=1, batch_size=8, window=0)
    two_threads = plan_partitions(net, 1, threads=2, batch_size=8, window=0)
    n = net.layout.size
    assert one.partitions[0].memory == BASE_BYTES + 4 * n * 6  # weights, 2 accs, 2 buffers, replay
    assert two_threads.partitions[0].memory - one.partitions[0].memory == 4 * n * 2


def test_the_check_names_the_partition_over_the_budget_in_one_line():
    net = _net(MNIST)
    plan = plan_partitions(net, 3, threads=1, batch_size=8)
    worst = max(plan.partitions, key=lambda p: p.memory)
    plan.check(worst.memory)  # fits exactly
    with pytest.raises(PartitionError) as e:
        plan.check(worst.memory - 1)
    assert e.value.partition == worst.index
    msg = str(e.value)
    assert f"partition {worst.index} of 3" in msg and "--partitions" in msg
    assert len(msg.splitlines()) == 1


def test_more_partitions_than_pieces_is_refused():
    with pytest.raises(PartitionError, match="partitions for a network of 2 layers"):
        plan_partitions(_net("maxpool2,fc2"), 3, threads=1, batch_size=8)
    with pytest.raises(PartitionError, match="partitions=0"):
        plan_partitions(_net(MNIST), 0, threads=1, batch_size=8)


def test_the_offload_rule_picks_the_dense_layers_whose_terms_cost_less_than_their_delta():
    """The paper's rule: a dense layer's ``k * (in + out)`` floats of activations and errors
    per push against its ``in * out`` weight delta (its terms' product is checked against the
    replica's own steps in tests/train/test_pipeline.py)."""
    from adam_dask.model.partition import profitable_offload

    net = Network.from_spec("conv3x3:4,maxpool2,fc32,fc4", (1, 10, 10), seed=1)
    assert profitable_offload(net, 16) == ["2"]  # fc32: 16 * 96 < 2048; fc4: 16 * 36 > 128
    assert profitable_offload(net, 64) == []  # 64 * 96 > 2048
