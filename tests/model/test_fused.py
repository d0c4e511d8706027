"""The fused mini-batch step: the same parameters as the layer-by-layer step, gradients that match
finite differences, its dense kernel against the float64 reference, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adam_dask.errors import InputShapeError
from adam_dask.model import Network
from adam_dask.model import fused as F
from adam_dask.model import kernels as K
from adam_dask.model import reference as R

SPECS = [
    ("conv3x3:3,maxpool2,conv2x2:4,fc6,fc3", (2, 9, 9)),  # conv, pool (odd edge), conv, fc
    ("conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc40,fc40,fc10", (1, 28, 28)),  # the paper's kinds
    ("fc50,fc20,fc10", (1, 8, 8)),  # dense first: the large-model benchmark's kind
    ("maxpool2,conv3x3:5,fc7", (3, 10, 11)),  # pooling first, 3 channels
    ("fc9,fc3", (1, 40, 30)),  # 1200 inputs: the dense kernel's column tiles (1024 at 8 images)
]


def batch(net: Network, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, *net.input_shape), dtype=np.float32)
    y = rng.integers(0, net.classes, n).astype(np.int64)
    return x, y


@pytest.mark.parametrize("spec, shape", SPECS)
@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_step_equals_backward_then_sgd_update(spec, shape, activation, momentum):
    a = Network.from_spec(spec, shape, activation, seed=1)
    b = a.copy()
    ca, cb = a.context(8), b.context(8)
    va = np.zeros(a.layout.size if momentum else 1, np.float32)
    vb = va.copy()
    acc_a = np.zeros(a.layout.size, np.float32)  # the updates, summed
    acc_b = np.full(a.layout.size, 0.5, np.float32)  # step_into adds to what is there
    for step, n in enumerate([8, 5, 8, 1]):  # full and partial batches
        x, y = batch(a, 8, seed=step)
        la = a.backward_into(ca, x, y, n)
        acc_a += (momentum * va if momentum else 0.0) - np.float32(0.05) * ca.grad
        K.sgd_update(a.flat, ca.grad, va, 0.05, momentum)
        lb = b.step_into(cb, x, y, n, 0.05, momentum, vb, acc=acc_b)
        assert lb == pytest.approx(la, rel=1e-6)
        np.testing.assert_allclose(b.flat, a.flat, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(vb, va, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(acc_b - 0.5, acc_a, rtol=1e-5, atol=1e-6)
        assert not cb.grad.any(), "the step leaves the gradient buffer zeroed"
    assert not np.array_equal(b.flat, Network.from_spec(spec, shape, activation, seed=1).flat)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_fused_step_follows_the_finite_difference_gradient(activation):
    spec, shape = SPECS[0]
    net = Network.from_spec(spec, shape, activation, seed=3)
    x, y = batch(net, 4, seed=1)
    before, step_grad = applied_gradient(net, x, y)

    assert_follows_finite_differences(
        net, before, step_grad, lambda p: R.network_loss(net.layers, p, x, y, activation)
    )


def applied_gradient(net: Network, x, y, lr: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """One plain SGD step of ``net`` on ``x``, ``y``: ``(weights before (float64), what the
    step applied / lr)``, the gradient it followed."""
    before = net.flat.astype(np.float64)
    net.step_into(net.context(len(x)), x, y, None, lr, 0.0, np.zeros(1, np.float32))
    return before, (before - net.flat.astype(np.float64)) / lr


def params_of(net: Network, flat64: np.ndarray) -> dict:
    """``flat64`` (float64, like net.flat) as the reference's name -> array parameters."""
    return {e.name: flat64[e.offset : e.offset + e.size].reshape(e.shape) for e in net.layout}


def assert_follows_finite_differences(net, before, step_grad, loss_of_params) -> None:
    """``step_grad`` (what a step applied, / lr) matches central differences of
    ``loss_of_params`` at ``before`` on 5 random entries of every parameter."""
    rng = np.random.default_rng(0)
    eps = 1e-6
    for e in net.layout:
        for i in rng.choice(e.size, min(e.size, 5), replace=False) + e.offset:
            wp, wm = before.copy(), before.copy()
            wp[i] += eps
            wm[i] -= eps
            fd = (loss_of_params(params_of(net, wp)) - loss_of_params(params_of(net, wm))) / (
                2 * eps
            )
            # float32 weights: the applied step is exact to ~1e-7 / lr of the gradient
            assert abs(fd - step_grad[i]) <= 2e-3 + 2e-3 * abs(fd), (e.name, i, fd, step_grad[i])


def test_fused_step_records_the_same_dense_terms():
    spec, shape = SPECS[0]
    a = Network.from_spec(spec, shape, "relu", seed=2)
    b = a.copy()
    x, y = batch(a, 6, seed=4)
    ta: dict = {}
    tb: dict = {}
    a.backward_into(a.context(6), x, y, 5, dense_terms=ta)
    b.step_into(b.context(6), x, y, 5, 0.1, 0.0, np.zeros(1, np.float32), dense_terms=tb)
    assert set(ta) == set(tb) == {"3", "4"}
    for k in ta:
        for u, v in zip(ta[k], tb[k], strict=True):
            assert u.shape == v.shape and u.shape[0] == 5
            np.testing.assert_array_equal(u, v)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 9),
    st.integers(1, 9),
    st.integers(1, 9),
    st.sampled_from([0.0, 0.5]),
    st.integers(0, 2**31),
)
def test_dense_backward_update_matches_reference_and_finite_differences(B, I, O, momentum, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, I)).astype(np.float32)
    w = rng.standard_normal((O, I)).astype(np.float32)
    b = rng.standard_normal(O).astype(np.float32)
    dout = rng.standard_normal((B, O)).astype(np.float32)
    vw = (
        rng.standard_normal((O, I)).astype(np.float32) if momentum else np.zeros((0, I), np.float32)
    )
    vb = rng.standard_normal(O).astype(np.float32) if momentum else np.zeros(0, np.float32)
    lr = 0.1
    ref = R.dense_backward_update(
        dout, x, w, b, lr, momentum, vw if momentum else None, vb if momentum else None
    )
    w1, b1, vw1, vb1 = w.copy(), b.copy(), vw.copy(), vb.copy()
    dx = np.full((B, I), 3.0, np.float32)  # overwritten
    aw, ab = np.ones((O, I), np.float32), np.ones(O, np.float32)  # accumulators
    row = np.zeros(I, np.float32)
    F.dense_backward_update(dx, w1, b1, vw1, vb1, aw, ab, row, dout, x, lr, momentum, True)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(dx, ref[0], **tol)
    np.testing.assert_allclose(w1, ref[1], **tol)
    np.testing.assert_allclose(b1, ref[2], **tol)
    np.testing.assert_allclose(aw - 1, ref[1] - w, **tol)  # the update, added to aw and ab
    np.testing.assert_allclose(ab - 1, ref[2] - b, **tol)
    if momentum:
        np.testing.assert_allclose(vw1, ref[3], **tol)
        np.testing.assert_allclose(vb1, ref[4], **tol)
    else:
        # plain SGD: what the kernel subtracted, / lr, is the finite-difference gradient of
        # sum(dense(x) * dout) with respect to the weights and the bias
        d64 = dout.astype(np.float64)
        w64 = w.astype(np.float64)
        fd_w = np.zeros((O, I))
        for o in range(O):
            for i in range(I):
                wp, wm = w64.copy(), w64.copy()
                wp[o, i] += 1e-6
                wm[o, i] -= 1e-6
                fp = (R.dense_forward(x, wp, b) * d64).sum()
                fm = (R.dense_forward(x, wm, b) * d64).sum()
                fd_w[o, i] = (fp - fm) / 2e-6
        np.testing.assert_allclose((w - w1.astype(np.float64)) / lr, fd_w, rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(
            (b - b1.astype(np.float64)) / lr, d64.sum(0), rtol=1e-3, atol=1e-4
        )
    # without need_dx and accumulators (empty), the update is the same
    w2, b2, vw2, vb2 = w.copy(), b.copy(), vw.copy(), vb.copy()
    none = np.zeros((0, I), np.float32)
    F.dense_backward_update(
        none, w2, b2, vw2, vb2, none, np.zeros(0, np.float32), row, dout, x, lr, momentum, False
    )
    np.testing.assert_array_equal(w2, w1)
    np.testing.assert_array_equal(b2, b1)


@pytest.mark.parametrize("B, momentum", [(8, 0.0), (3, 0.9), (32, 0.0)])
def test_dense_backward_update_over_several_column_tiles(B, momentum):
    # 2100 inputs: two full tiles and a partial one at 8 images; 7 outputs: a block of four
    # rows and three left over
    I, O = 2100, 7
    rng = np.random.default_rng(B)
    x = rng.standard_normal((B, I)).astype(np.float32)
    w = rng.standard_normal((O, I)).astype(np.float32)
    b = rng.standard_normal(O).astype(np.float32)
    dout = rng.standard_normal((B, O)).astype(np.float32)
    vw = rng.standard_normal((O, I)).astype(np.float32)
    vb = rng.standard_normal(O).astype(np.float32)
    ref = R.dense_backward_update(dout, x, w, b, 0.1, momentum, vw, vb)
    dx, aw, ab = np.zeros((B, I), np.float32), np.zeros((O, I), np.float32), np.zeros(O, np.float32)
    F.dense_backward_update(
        dx, w, b, vw, vb, aw, ab, np.zeros(I, np.float32), dout, x, 0.1, momentum, True
    )
    tol = {"rtol": 1e-4, "atol": 1e-4}
    for got, want in zip((dx, w, b), ref[:3], strict=True):
        np.testing.assert_allclose(got, want, **tol)
    np.testing.assert_allclose(aw, ref[3], **tol)  # every update landed once in the accumulator
    np.testing.assert_allclose(ab, ref[4], **tol)


def test_fused_step_refuses_unsafe_arguments():
    spec, shape = SPECS[0]
    net = Network.from_spec(spec, shape, "relu", seed=0)
    ctx = net.context(4)
    x, y = batch(net, 8)
    v = np.zeros(1, np.float32)
    with pytest.raises(InputShapeError, match="batch size"):
        net.step_into(ctx, x, y, 8, 0.1, 0.0, v)  # more images than the context holds
    with pytest.raises(InputShapeError, match="batch size"):
        net.step_into(ctx, x[:2], y[:2], 3, 0.1, 0.0, v)
    with pytest.raises(InputShapeError, match="velocity"):
        net.step_into(ctx, x, y, 4, 0.1, 0.9, v)  # momentum without a velocity like flat
    other = Network.from_spec("fc5,fc3", shape, "relu", seed=0)
    with pytest.raises(InputShapeError, match="another network"):
        other.step_into(ctx, x, y, 4, 0.1, 0.0, v)
    with pytest.raises(InputShapeError, match="accumulator"):
        net.step_into(ctx, x, y, 4, 0.1, 0.0, v, acc=np.zeros(3, np.float32))
    before = net.flat.copy()
    net.step_into(ctx, x, y, 4, 0.1, 0.0, v)  # and a valid step still works afterwards
    assert not np.array_equal(before, net.flat)


# -- dropout (a named option; the paper's network has none) ----------------------------------------


def test_dropout_kernels_match_the_reference_and_keep_the_mean():
    rng = np.random.default_rng(0)
    y = rng.random(20000).astype(np.float32) + 0.1  # relu outputs, none exactly 0
    out = y.copy()
    K.dropout_forward(out, 0.25, 7)
    mask = (out != 0).astype(np.float64)
    assert abs(1 - mask.mean() - 0.25) < 0.02  # about a quarter dropped
    np.testing.assert_allclose(out, R.dropout_forward(y, mask, 0.25), rtol=1e-6)
    assert abs(out.mean() / y.mean() - 1) < 0.02  # the expected output is kept
    again = y.copy()
    K.dropout_forward(again, 0.25, 7)
    np.testing.assert_array_equal(again, out)  # a seed repeats its draws
    dy = rng.normal(size=y.size).astype(np.float32)
    d = dy.copy()
    K.dropout_backward(d, out, 0.25)
    np.testing.assert_allclose(d, R.dropout_backward(dy, mask, 0.25), rtol=1e-6)


def test_fused_step_with_dropout_follows_the_finite_difference_gradient():
    """The masks the step drew (its hidden dense outputs that are 0) in the float64 reference
    loss: the applied update is that loss's gradient."""
    spec, shape = "conv3x3:3,maxpool2,fc12,fc9,fc3", (1, 9, 9)
    net = Network.from_spec(spec, shape, "relu", seed=3, dropout=0.5)
    x, y = batch(net, 6, seed=1)
    ctx = net.context(6)
    before = net.flat.astype(np.float64)
    lr = 1e-3
    F.step(net, ctx, x, y, None, lr, 0.0, np.zeros(1, np.float32), seed=11)
    step_grad = (before - net.flat.astype(np.float64)) / lr
    hidden = [j for j, L in enumerate(net.layers) if L.kind == "fc"][:-1]
    masks = {net.layers[j].index: (ctx.acts[j][:6] != 0).astype(np.float64) for j in hidden}
    assert 0.2 < np.mean([m.mean() for m in masks.values()]) < 0.8  # units were dropped

    def loss(params):
        return R.network_loss(net.layers, params, x, y, "relu", masks=masks, p=0.5)

    assert_follows_finite_differences(net, before, step_grad, loss)
    # without the masks the loss differs: dropout changed the step
    plain = params_of(net, before)
    assert R.network_loss(net.layers, plain, x, y, "relu") != pytest.approx(loss(plain))


def test_dropout_is_checked_and_travels_with_the_network():
    from adam_dask.errors import ModelSpecError

    with pytest.raises(ModelSpecError, match="relu"):
        Network.from_spec("fc8,fc3", (1, 4, 4), "tanh", dropout=0.5)
    with pytest.raises(ModelSpecError, match=r"\[0, 1\)"):
        Network.from_spec("fc8,fc3", (1, 4, 4), "relu", dropout=1.0)
    net = Network.from_spec("fc8,fc3", (1, 4, 4), "relu", dropout=0.3)
    assert Network.from_dict(net.to_dict()).dropout == 0.3 and net.copy().dropout == 0.3
    # inference never drops: the same outputs every time
    x = np.random.default_rng(0).random((5, 1, 4, 4), dtype=np.float32)
    np.testing.assert_array_equal(net.forward(x), net.forward(x))


# -- label smoothing (a named option; the paper's loss is plain cross-entropy) -----------------------


def test_fused_step_with_label_smoothing_follows_the_finite_difference_gradient():
    spec, shape = SPECS[0]
    net = Network.from_spec(spec, shape, "relu", seed=3, label_smoothing=0.2)
    x, y = batch(net, 4, seed=1)
    before, step_grad = applied_gradient(net, x, y)

    def loss(params):
        return R.network_loss(net.layers, params, x, y, "relu", smoothing=0.2)

    assert_follows_finite_differences(net, before, step_grad, loss)
    # the plain loss differs: smoothing changed the objective the step descends
    plain = params_of(net, before)
    assert R.network_loss(net.layers, plain, x, y, "relu") != pytest.approx(loss(plain))


def test_label_smoothing_is_the_same_in_the_fused_and_layer_by_layer_paths():
    spec, shape = SPECS[0]
    a = Network.from_spec(spec, shape, "relu", seed=1, label_smoothing=0.1)
    b = a.copy()
    ca, cb = a.context(8), b.context(8)
    x, y = batch(a, 8, seed=2)
    la = a.backward_into(ca, x, y)
    K.sgd_update(a.flat, ca.grad, np.zeros(1, np.float32), 0.05, 0.0)
    lb = b.step_into(cb, x, y, None, 0.05, 0.0, np.zeros(1, np.float32))
    assert lb == pytest.approx(la, rel=1e-6)
    np.testing.assert_allclose(b.flat, a.flat, rtol=1e-6, atol=1e-7)


def test_label_smoothing_is_checked_and_travels_with_the_network():
    from adam_dask.errors import ModelSpecError

    with pytest.raises(ModelSpecError, match="label_smoothing"):
        Network.from_spec("fc8,fc3", (1, 4, 4), "relu", label_smoothing=1.0)
    net = Network.from_spec("fc8,fc3", (1, 4, 4), "tanh", label_smoothing=0.1)
    assert net.to_dict()["label_smoothing"] == 0.1
    assert Network.from_dict(net.to_dict()).label_smoothing == 0.1
    assert net.copy().label_smoothing == 0.1
    assert Network.from_spec("fc8,fc3", (1, 4, 4), "tanh").label_smoothing == 0.0
