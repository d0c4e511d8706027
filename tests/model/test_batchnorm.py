"""Batch normalisation (``bn`` in a spec, a named option; the paper's network has none): the
fused step equals the layer-by-layer one and follows finite differences of the float64
reference, inference uses the population statistics that ``calibrate`` recomputes, and a
network without them refuses to infer instead of guessing."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.errors import ModelSpecError
from adam_dask.model import Network
from adam_dask.model import kernels as K
from adam_dask.model import reference as R

from .test_fused import applied_gradient, assert_follows_finite_differences, batch

# conv -> bn -> pool (odd edge), conv -> bn (no pool), fc -> bn, then the logits
SPEC, SHAPE = "conv3x3:3,bn,maxpool2,conv2x2:4,bn,fc6,bn,fc3", (2, 9, 9)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_step_with_batch_norm_equals_backward_then_sgd_update(activation, momentum):
    a = Network.from_spec(SPEC, SHAPE, activation, seed=1)
    b = a.copy()
    start = a.flat.copy()
    ca, cb = a.context(8), b.context(8)
    va = np.zeros(a.layout.size if momentum else 1, np.float32)
    vb = va.copy()
    acc = np.zeros(a.layout.size, np.float32)
    for step, n in enumerate([8, 5, 8, 2]):
        x, y = batch(a, 8, seed=step)
        la = a.backward_into(ca, x, y, n)
        K.sgd_update(a.flat, ca.grad, va, 0.05, momentum)
        lb = b.step_into(cb, x, y, n, 0.05, momentum, vb, acc=acc)
        assert lb == pytest.approx(la, rel=1e-5)
        np.testing.assert_allclose(b.flat, a.flat, rtol=1e-5, atol=1e-6)
        assert not cb.grad.any()
    bn = a.parameters["1.weight"]
    assert not np.allclose(bn, 1.0), "the scales of the bn layer were trained"
    # the accumulator a replica pushes holds every update, the bn layers' included
    np.testing.assert_allclose(acc, b.flat - start, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_fused_step_with_batch_norm_follows_the_finite_difference_gradient(activation):
    net = Network.from_spec(SPEC, SHAPE, activation, seed=3)
    rng = np.random.default_rng(7)
    for name in ("1.weight", "4.weight", "6.weight"):  # scales away from 1, to see their effect
        net.parameters[name][...] = rng.uniform(0.5, 1.5, net.parameters[name].shape)
    for name in ("1.bias", "4.bias", "6.bias"):
        net.parameters[name][...] = rng.uniform(-0.3, 0.3, net.parameters[name].shape)
    x, y = batch(net, 6, seed=1)
    before, step_grad = applied_gradient(net, x, y)

    def loss(params):
        return R.network_loss(net.layers, params, x, y, activation)

    assert_follows_finite_differences(net, before, step_grad, loss)


def test_calibrate_sets_the_population_statistics_layer_by_layer():
    net = Network.from_spec(SPEC, SHAPE, "relu", seed=2)
    x, y = batch(net, 40, seed=3)
    x = x * 3 + 1  # a mean and spread the first layer's statistics must find
    with pytest.raises(ModelSpecError, match="calibrate"):
        net.predict(x)
    net.calibrate(x, batch_size=7)  # in chunks: the same statistics as all at once
    chunked = {i: s.copy() for i, s in net.population.items()}
    net.calibrate(x, batch_size=40)
    assert sorted(net.population) == [1, 4, 6]
    for i, s in net.population.items():
        np.testing.assert_allclose(chunked[i], s, rtol=1e-4, atol=1e-5)
    # the first bn layer's statistics are those of the first conv's outputs over every image
    conv = R.conv2d_forward(x, net.parameters["0.weight"], net.parameters["0.bias"])
    np.testing.assert_allclose(net.population[1][0], conv.mean(axis=(0, 2, 3)), rtol=1e-4)
    np.testing.assert_allclose(net.population[1][1], conv.var(axis=(0, 2, 3)), rtol=1e-3)
    # with every image in one batch, inference normalises exactly as training does
    ctx = net.context(40)
    train_logits = net.forward_into(ctx, x, train=True).copy()
    np.testing.assert_allclose(net.forward(x, batch_size=40), train_logits, rtol=1e-3, atol=1e-3)
    # and, unlike training, one image at a time gives the same answers
    np.testing.assert_allclose(net.forward(x, batch_size=1), net.forward(x), rtol=1e-4, atol=1e-5)


def test_population_statistics_follow_the_weights():
    net = Network.from_spec(SPEC, SHAPE, "relu", seed=2)
    x, _ = batch(net, 16, seed=3)
    net.calibrate(x)
    twin = net.copy()
    np.testing.assert_array_equal(twin.predict(x), net.predict(x))
    net.flat = net.flat * 1.5  # new weights: the old statistics would mislead
    assert net.population == {}
    with pytest.raises(ModelSpecError, match="calibrate"):
        net.evaluate(x, np.zeros(16, np.int64))
    # a description round-trips the spec; the statistics are recomputed, not stored
    again = Network.from_dict(twin.to_dict())
    assert again.batch_norm and again.population == {}
    assert not Network.from_spec("fc8,fc3", (1, 4, 4), "relu").batch_norm


@pytest.mark.parametrize(
    "spec, what",
    [
        ("bn,fc3", "must follow a conv or fc"),
        ("conv3x3:2,maxpool2,bn,fc3", "must follow a conv or fc"),
        ("conv3x3:2,bn,bn,fc3", "must follow a conv or fc"),
        ("fc8,fc3,bn", "last layer must be fc"),
    ],
)
def test_misplaced_batch_norm_is_refused_with_the_layer(spec, what):
    with pytest.raises(ModelSpecError, match=what):
        Network.from_spec(spec, (1, 8, 8), "relu")


def test_dropout_before_a_dense_layers_batch_norm_is_refused():
    with pytest.raises(ModelSpecError, match="dropout"):
        Network.from_spec("fc8,bn,fc3", (1, 4, 4), "relu", dropout=0.2)
    # on the conv layers' bn, dropout (on the dense layers) is fine
    Network.from_spec("conv3x3:2,bn,fc8,fc3", (1, 6, 6), "relu", dropout=0.2)
