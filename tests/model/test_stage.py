"""Stages of a partitioned network: forward and backward through the stages equal the whole
network's (the gradient of one mini-batch, split over the stages)."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.model import Network
from adam_dask.model.stage import WholeStage, stages_of

SPECS = [
    ("conv5x5:6,maxpool2,fc32,fc10", (1, 12, 12), [(0, 2), (2, 4)]),
    ("conv5x5:6,maxpool2,fc32,fc10", (1, 12, 12), [(0, 1), (1, 3), (3, 4)]),
    ("conv3x3:4,bn,maxpool2,fc16,fc24,fc10", (1, 10, 10), [(0, 1), (1, 4), (4, 6)]),
    ("fc40,fc30,fc10", (1, 6, 6), [(0, 1), (1, 2), (2, 3)]),
    # a dense layer split by output neurons (paper Figure 6): the middle one, the first, the last
    ("conv5x5:6,maxpool2,fc32,fc10", (1, 12, 12), [(0, 2), (2, 3, 0, 10), (2, 3, 10, 32), (3, 4)]),
    ("fc40,fc30,fc10", (1, 6, 6), [(0, 1, 0, 15), (0, 1, 15, 27), (0, 1, 27, 40), (1, 3)]),
    ("conv5x5:6,maxpool2,fc32,fc10", (1, 12, 12), [(0, 3), (3, 4, 0, 4), (3, 4, 4, 10)]),
]


def _partitioned_gradient(net, bounds, x, y):
    stages = stages_of(net, bounds)
    n = len(x)
    ctxs = [s.context(n) for s in stages]
    accs = [np.zeros(s.size, np.float32) for s in stages]
    inp = x
    for s, c in zip(stages, ctxs):
        inp = s.forward_into(c, inp, n).copy()
    logits = inp
    loss = 0.0
    dout = None
    for k in range(len(stages) - 1, -1, -1):
        s, c = stages[k], ctxs[k]
        if s.last:
            loss = s.backward_update(c, n, 1.0, accs[k], labels=y)
        else:
            s.backward_update(c, n, 1.0, accs[k], dout=dout)
        dout = c.din
    grad = np.zeros_like(net.flat)
    for s, a in zip(stages, accs):
        grad[s.start : s.stop] = -a
    return loss, grad, logits, stages


@pytest.mark.parametrize(("spec", "shape", "bounds"), SPECS)
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_the_stages_gradient_of_a_mini_batch_equals_the_whole_networks(
    spec, shape, bounds, activation
):
    net = Network.from_spec(spec, input_shape=shape, activation=activation, seed=1)
    rng = np.random.default_rng(0)
    x = rng.random((6, *shape), dtype=np.float32)
    y = rng.integers(0, 10, 6)
    want_loss, want_grad = net.loss_and_gradient(x, y)
    loss, grad, logits, stages = _partitioned_gradient(net, bounds, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-4, atol=2e-6)
    # each stage moved its own weights by -lr * its part of the gradient, and only those
    for s in stages:
        np.testing.assert_allclose(
            s.flat, net.flat[s.start : s.stop] - want_grad[s.start : s.stop], rtol=1e-4, atol=1e-5
        )


def test_a_stage_holds_only_its_layers_parameters():
    net = Network.from_spec("conv5x5:6,maxpool2,fc32,fc10", input_shape=(1, 12, 12), seed=0)
    a, b = stages_of(net, [(0, 2), (2, 4)])
    assert (a.start, a.stop) == (0, net.layout["0.bias"].offset + 6)
    assert (b.start, b.stop) == (a.stop, net.layout.size)
    assert sorted(b.parameters) == ["2.bias", "2.weight", "3.bias", "3.weight"]
    assert a.out_shape == (6, 4, 4) and b.in_shape == (6, 4, 4)
    with pytest.raises(ValueError, match="consecutive"):
        stages_of(net, [(0, 2), (3, 4)])
    with pytest.raises(ValueError, match="consecutive"):
        stages_of(net, [(0, 2), (2, 3, 0, 10), (2, 3, 12, 32), (3, 4)])


def test_a_dense_layers_slices_hold_its_rows_and_the_last_one_its_bias():
    net = Network.from_spec("fc40,fc30,fc10", input_shape=(1, 6, 6), seed=0)
    a, b, c = stages_of(net, [(0, 1, 0, 15), (0, 1, 15, 40), (1, 3)])
    w = net.layout["0.weight"]
    assert (a.start, a.stop) == (w.offset, w.offset + 15 * 36)
    assert (b.start, b.stop) == (a.stop, net.layout["0.bias"].offset + 40)  # rows 15-39 + bias
    np.testing.assert_array_equal(a.weight, net.parameters["0.weight"][:15])
    np.testing.assert_array_equal(b.bias, net.parameters["0.bias"])
    assert a.bias is None and (a.in_shape, a.out_shape) == ((1, 6, 6), (36 + 15,))
    assert (b.in_shape, b.out_shape) == ((36 + 15,), (40,)) and c.in_shape == (40,)


@pytest.mark.parametrize(("spec", "shape", "bounds"), [SPECS[2], SPECS[4], SPECS[5]])
def test_the_stages_momentum_steps_equal_the_whole_networks(spec, shape, bounds):
    """Two steps with momentum (each stage's velocity its own, like its weights) move every
    weight as SGD with momentum on the whole network does: v = mu v - lr g, w += v."""
    lr, mu = 0.1, 0.9
    net = Network.from_spec(spec, input_shape=shape, activation="relu", seed=2)
    ref = Network.from_spec(spec, input_shape=shape, activation="relu", seed=2)
    stages = stages_of(net, bounds)
    vels = [np.zeros(s.size, np.float32) for s in stages]
    v = np.zeros_like(ref.flat)
    rng = np.random.default_rng(3)
    for _ in range(2):
        x = rng.random((5, *shape), dtype=np.float32)
        y = rng.integers(0, 10, 5)
        _, g = ref.loss_and_gradient(x, y)
        v = mu * v - lr * g
        ref.flat += v
        ctxs = [s.context(5) for s in stages]
        inp = x
        for s, c in zip(stages, ctxs):
            inp = s.forward_into(c, inp, 5).copy()
        dout = None
        for k in range(len(stages) - 1, -1, -1):
            s, c, acc = stages[k], ctxs[k], np.zeros(stages[k].size, np.float32)
            kw = {"labels": y} if s.last else {"dout": dout}
            s.backward_update(c, 5, lr, acc, velocity=vels[k], momentum=mu, **kw)
            np.testing.assert_allclose(acc, vels[k], rtol=1e-6)  # what it pushes is its step
            dout = c.din
    for s, vel in zip(stages, vels):
        np.testing.assert_allclose(s.flat, ref.flat[s.start : s.stop], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(vel, v[s.start : s.stop], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
    ("spec", "shape", "bounds"),
    [
        ("conv3x3:4,maxpool2,fc24,fc16,fc10", (1, 10, 10), [(0, 3), (3, 5)]),
        ("fc40,fc30,fc10", (1, 6, 6), [(0, 1), (1, 2, 0, 12), (1, 2, 12, 30), (2, 3)]),
    ],
)
def test_the_stages_dropout_step_equals_the_whole_networks_with_the_same_draws(spec, shape, bounds):
    """Inverted dropout on the hidden dense layers, in the stages (a sliced layer's last slice
    drops the layer's whole output): with the thread's generator seeded alike, the stages run
    one after the other draw the masks the whole network's fused step draws, and move every
    weight as it does (with the rate of dropout 0, they would differ)."""
    from adam_dask.model import fused as F
    from adam_dask.model import kernels as K

    lr, seed, n = 0.1, 11, 6
    net = Network.from_spec(spec, input_shape=shape, activation="relu", seed=4, dropout=0.5)
    stages = stages_of(net, bounds)
    rng = np.random.default_rng(5)
    x = rng.random((n, *shape), dtype=np.float32)
    y = rng.integers(0, 10, n)
    acc = np.zeros_like(net.flat)
    F.step(net, net.context(n), x, y, n, lr, 0.0, np.zeros(1, np.float32), acc, None, seed)
    K.dropout_forward(np.zeros(0, np.float32), 0.5, seed)  # seeds the draws, draws none
    ctxs = [s.context(n) for s in stages]
    inp = x
    for s, c in zip(stages, ctxs):
        inp = s.forward_into(c, inp, n).copy()
    dout = None
    for k in range(len(stages) - 1, -1, -1):
        s, c = stages[k], ctxs[k]
        a = np.zeros(s.size, np.float32)
        s.backward_update(c, n, lr, a, **({"labels": y} if s.last else {"dout": dout}))
        np.testing.assert_allclose(a, acc[s.start : s.stop], rtol=1e-4, atol=1e-6)
        dout = c.din
    dropped = [c.acts[-1] for s, c in zip(stages, ctxs) if not s.last]
    assert any((d == 0).mean() > 0.3 for d in dropped)  # the masks were drawn
    for s in stages:
        np.testing.assert_allclose(s.flat, net.flat[s.start : s.stop], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("spec", "shape"), [(s, sh) for s, sh, _ in SPECS[:4]])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_whole_model_stage_runs_the_fused_step_as_its_layer_loops_do(spec, shape, momentum):
    """The whole model as one stage (a WholeStage) trains with the fused step (one numba
    call, a whole replica's) and moves its weights, its accumulator and its velocity as a
    stage of every layer does with its layer loops."""
    net = Network.from_spec(spec, input_shape=shape, activation="relu", seed=4)
    (loops,) = stages_of(net, [(0, len(net.layers))])
    fused = WholeStage(Network.from_dict(net.to_dict()))
    fused.flat[...] = net.flat
    assert fused.flat is fused.whole.flat and fused.size == loops.size  # one buffer
    acc_f, acc_l = (np.zeros(fused.size, np.float32) for _ in range(2))
    vel_f, vel_l = (np.zeros(fused.size, np.float32) for _ in range(2))
    ctx_f, ctx_l = fused.context(6), loops.context(6)
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = rng.random((6, *shape), dtype=np.float32)
        y = rng.integers(0, 10, 6).astype(np.int64)
        lf = fused.step(ctx_f, x, y, 6, 0.1, acc_f, velocity=vel_f, momentum=momentum)
        loops.forward_into(ctx_l, x, 6)
        ll = loops.backward_update(
            ctx_l, 6, 0.1, acc_l, labels=y, velocity=vel_l, momentum=momentum
        )
        assert lf == pytest.approx(ll, rel=1e-4)
    assert np.abs(acc_f).max() > 0  # the step moved the weights
    np.testing.assert_allclose(fused.flat, loops.flat, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(acc_f, acc_l, rtol=1e-3, atol=1e-5)
    if momentum:
        np.testing.assert_allclose(vel_f, vel_l, rtol=1e-3, atol=1e-5)
