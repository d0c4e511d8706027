"""Each numba kernel against its numpy reference, and the reference gradients against finite
differences (float64), on small shapes drawn by hypothesis."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adam_dask.model import kernels as K
from adam_dask.model import reference as R

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RTOL, ATOL = 1e-4, 1e-5


def fd_grad(f, x, eps=1e-6):
    """Central finite-difference gradient of the scalar f at x (float64)."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f(x)
        flat[i] = old - eps
        fm = f(x)
        flat[i] = old
        gf[i] = (fp - fm) / (2 * eps)
    return g


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


conv_shapes = st.tuples(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 2**31),
)


@SETTINGS
@given(conv_shapes)
def test_conv2d_matches_reference_and_finite_differences(shape):
    B, C, OC, KH, KW, dh, dw_, seed = shape
    H, W = KH + dh, KW + dw_ + 1
    rng = np.random.default_rng(seed)
    x, w, b = rand(rng, B, C, H, W), rand(rng, OC, C, KH, KW), rand(rng, OC)
    OH, OW = H - KH + 1, W - KW + 1
    out = np.zeros((B, OC, OH, OW), np.float32)
    cols = np.zeros((B, C * KH * KW, OH * OW), np.float32)
    K.conv2d_forward(out, cols, x, w, b)
    np.testing.assert_allclose(out, R.conv2d_forward(x, w, b), rtol=RTOL, atol=ATOL)

    dout = rand(rng, B, OC, OH, OW)
    dx = np.full((B, C, H, W), 7.0, np.float32)  # overwritten
    dcols = np.zeros((C * KH * KW, OH * OW), np.float32)
    K.conv2d_backward_input(dx, dcols, dout, w)
    ref_dx = R.conv2d_backward_input(dout, w, H, W)
    np.testing.assert_allclose(dx, ref_dx, rtol=RTOL, atol=ATOL)

    dw = np.ones_like(w)  # accumulated into
    db = np.ones_like(b)
    K.conv2d_backward_weights(dw, db, dout, cols)
    ref_dw, ref_db = R.conv2d_backward_weights(dout, x, KH, KW)
    np.testing.assert_allclose(dw - 1, ref_dw, rtol=RTOL, atol=1e-4)
    np.testing.assert_allclose(db - 1, ref_db, rtol=RTOL, atol=1e-4)

    d64 = dout.astype(np.float64)
    np.testing.assert_allclose(
        fd_grad(lambda v: (R.conv2d_forward(v, w, b) * d64).sum(), x), ref_dx, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        fd_grad(lambda v: (R.conv2d_forward(x, v, b) * d64).sum(), w), ref_dw, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        fd_grad(lambda v: (R.conv2d_forward(x, w, v) * d64).sum(), b), ref_db, rtol=1e-5, atol=1e-6
    )


@SETTINGS
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(2, 7),
    st.integers(2, 7),
    st.integers(0, 2**31),
)
def test_maxpool2_matches_reference_and_finite_differences(B, C, H, W, seed):
    rng = np.random.default_rng(seed)
    x = rand(rng, B, C, H, W)  # distinct values: no ties
    out = np.zeros((B, C, H // 2, W // 2), np.float32)
    arg = np.zeros(out.shape, np.int8)
    K.maxpool2_forward(out, arg, x)
    ref_out, ref_arg = R.maxpool2_forward(x)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(arg, ref_arg)

    dout = rand(rng, *out.shape)
    dx = np.full(x.shape, 3.0, np.float32)
    K.maxpool2_backward(dx, dout, arg)
    ref_dx = R.maxpool2_backward(dout, ref_arg, H, W)
    np.testing.assert_allclose(dx, ref_dx, rtol=0, atol=0)
    fd = fd_grad(lambda v: (R.maxpool2_forward(v)[0] * dout.astype(np.float64)).sum(), x)
    np.testing.assert_allclose(fd, ref_dx, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**31))
def test_dense_matches_reference_and_finite_differences(B, I, O, seed):
    rng = np.random.default_rng(seed)
    x, w, b = rand(rng, B, I), rand(rng, O, I), rand(rng, O)
    out = np.zeros((B, O), np.float32)
    K.dense_forward(out, x, w, b)
    np.testing.assert_allclose(out, R.dense_forward(x, w, b), rtol=RTOL, atol=ATOL)

    dout = rand(rng, B, O)
    ref_dx = R.dense_backward_input(dout, w)
    ref_dw, ref_db = R.dense_backward_weights(dout, x)
    dx = np.full((B, I), 5.0, np.float32)
    K.dense_backward_input(dx, dout, w)
    np.testing.assert_allclose(dx, ref_dx, rtol=RTOL, atol=ATOL)
    dw, db = np.ones_like(w), np.ones_like(b)
    K.dense_backward_weights(dw, db, dout, x)
    np.testing.assert_allclose(dw - 1, ref_dw, rtol=RTOL, atol=1e-4)
    np.testing.assert_allclose(db - 1, ref_db, rtol=RTOL, atol=1e-4)
    # the fused kernel the network uses gives the same
    dx2, dw2, db2 = np.full((B, I), 5.0, np.float32), np.zeros_like(w), np.zeros_like(b)
    K.dense_backward(dx2, dw2, db2, dout, x, w, True)
    np.testing.assert_allclose(dx2, ref_dx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dw2, ref_dw, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(db2, ref_db, rtol=RTOL, atol=ATOL)

    d64 = dout.astype(np.float64)
    np.testing.assert_allclose(
        fd_grad(lambda v: (R.dense_forward(v, w, b) * d64).sum(), x), ref_dx, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        fd_grad(lambda v: (R.dense_forward(x, v, b) * d64).sum(), w), ref_dw, rtol=1e-5, atol=1e-6
    )


@SETTINGS
@given(st.sampled_from(["tanh", "relu"]), st.integers(1, 40), st.integers(0, 2**31))
def test_activations_match_reference_and_finite_differences(name, n, seed):
    rng = np.random.default_rng(seed)
    z = rand(rng, 2, n)
    fwd, bwd = getattr(K, f"{name}_forward"), getattr(K, f"{name}_backward")
    rf, rb = getattr(R, f"{name}_forward"), getattr(R, f"{name}_backward")
    y = z.copy()
    fwd(y)
    np.testing.assert_allclose(y, rf(z), rtol=1e-5, atol=1e-6)
    dy = rand(rng, 2, n)
    dz = dy.copy()
    bwd(dz, y)
    np.testing.assert_allclose(dz, rb(dy, rf(z)), rtol=1e-5, atol=1e-6)
    z64 = z.astype(np.float64)
    z64[np.abs(z64) < 1e-3] = 0.5  # keep relu's kink out of the FD
    fd = fd_grad(lambda v: (rf(v) * dy.astype(np.float64)).sum(), z64)
    np.testing.assert_allclose(fd, rb(dy, rf(z64)), rtol=1e-5, atol=1e-6)


@SETTINGS
@given(
    st.integers(1, 6),
    st.integers(2, 12),
    st.integers(0, 2**31),
    st.sampled_from([0.0, 0.1, 0.5]),
)
def test_softmax_cross_entropy_matches_reference_and_finite_differences(B, Kc, seed, eps):
    rng = np.random.default_rng(seed)
    logits = rand(rng, B, Kc) * 3
    labels = rng.integers(0, Kc, B).astype(np.int64)
    probs, losses = np.zeros((B, Kc), np.float32), np.zeros(B, np.float32)
    loss = K.softmax_cross_entropy_forward(probs, losses, logits, labels, eps)
    ref_p, ref_loss = R.softmax_cross_entropy_forward(logits, labels, eps)
    np.testing.assert_allclose(probs, ref_p, rtol=1e-5, atol=1e-6)
    assert abs(loss - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    np.testing.assert_allclose(losses.mean(), ref_loss, rtol=1e-5)
    d = np.zeros((B, Kc), np.float32)
    K.softmax_cross_entropy_backward(d, probs, labels, np.float32(1.0 / B), eps)
    ref_d = R.softmax_cross_entropy_backward(ref_p, labels, eps)
    np.testing.assert_allclose(d, ref_d, rtol=1e-5, atol=1e-6)
    fd = fd_grad(lambda v: R.softmax_cross_entropy_forward(v, labels, eps)[1], logits)
    np.testing.assert_allclose(fd, ref_d, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 2**31),
)
def test_batchnorm_matches_reference_and_finite_differences(B, C, P, seed):
    rng = np.random.default_rng(seed)
    if B * P == 1:
        P = 2  # one value per channel has no spread: the gradient is 0 and FD says nothing
    x = rand(rng, B, C, P) * 2 + 3  # an offset mean, as a conv's output has
    gamma, beta = rand(rng, C) + 1.5, rand(rng, C)
    out, stats = np.zeros((B, C, P), np.float32), np.zeros((2, C), np.float32)
    K.batchnorm_forward(out, stats, x, gamma, beta, K.BN_EPS)
    np.testing.assert_allclose(out, R.batchnorm_forward(x, gamma, beta), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(stats[0], x.astype(np.float64).mean(axis=(0, 2)), rtol=1e-5)
    dout = rand(rng, B, C, P)
    dx = np.full((B, C, P), 9.0, np.float32)  # overwritten
    dg, db = np.full(C, 0.5, np.float32), np.full(C, 0.5, np.float32)  # accumulated into
    K.batchnorm_backward(dx, dg, db, dout, x, stats, gamma)
    ref_dx, ref_dg, ref_db = R.batchnorm_backward(dout, x, gamma)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(dg - 0.5, ref_dg, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db - 0.5, ref_db, rtol=1e-4, atol=1e-4)
    d64 = dout.astype(np.float64)
    fd_x = fd_grad(lambda v: (R.batchnorm_forward(v, gamma, beta) * d64).sum(), x)
    np.testing.assert_allclose(fd_x, ref_dx, rtol=1e-4, atol=1e-5)
    fd_g = fd_grad(lambda g: (R.batchnorm_forward(x, g, beta) * d64).sum(), gamma)
    np.testing.assert_allclose(fd_g, ref_dg, rtol=1e-4, atol=1e-5)
    # inference with the batch's own statistics gives the training output
    var = x.astype(np.float64).var(axis=(0, 2))
    inf = np.zeros_like(out)
    K.batchnorm_infer(inf, x, stats[0], var.astype(np.float32), gamma, beta, K.BN_EPS)
    np.testing.assert_allclose(inf, out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        R.batchnorm_infer(x, stats[0], var, gamma, beta), out, rtol=1e-4, atol=1e-4
    )


def test_label_smoothing_pulls_the_loss_minimum_off_the_one_hot():
    """With smoothing the loss is smallest at probs = the smoothed target, not at ever larger
    logits: the gradient of a confident correct answer points back (it is 0 without smoothing
    only in the limit)."""
    eps, Kc = 0.1, 10
    logits = np.zeros((1, Kc), np.float32)
    logits[0, 3] = 20.0  # probs[3] ~ 1
    probs, losses, d = (
        np.zeros((1, Kc), np.float32),
        np.zeros(1, np.float32),
        np.zeros((1, Kc), np.float32),
    )
    K.softmax_cross_entropy_forward(probs, losses, logits, np.array([3]), eps)
    K.softmax_cross_entropy_backward(d, probs, np.array([3]), np.float32(1.0), eps)
    assert d[0, 3] > 0.09 and (d[0, :3] < 0).all()  # lowers the winner, raises the rest
    K.softmax_cross_entropy_backward(d, probs, np.array([3]), np.float32(1.0), 0.0)
    assert abs(d[0, 3]) < 1e-6


def test_softmax_is_stable_for_large_logits():
    logits = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    probs, losses = np.zeros((1, 3), np.float32), np.zeros(1, np.float32)
    loss = K.softmax_cross_entropy_forward(probs, losses, logits, np.array([1]))
    assert np.isfinite(loss) and abs(loss - 1000.0) < 1e-3
    assert np.isfinite(probs).all()


def test_sgd_update_applies_and_zeroes_the_gradient():
    flat = np.ones(5, np.float32)
    grad = np.arange(5, dtype=np.float32)
    vel = np.zeros(1, np.float32)
    K.sgd_update(flat, grad, vel, 0.5, 0.0)
    np.testing.assert_allclose(flat, 1 - 0.5 * np.arange(5))
    assert not grad.any()
    flat, vel = np.zeros(3, np.float32), np.zeros(3, np.float32)
    for _ in range(2):
        grad = np.ones(3, np.float32)
        K.sgd_update(flat, grad, vel, 1.0, 0.5)
    np.testing.assert_allclose(vel, -1.5)  # 0.5 * -1 - 1
    np.testing.assert_allclose(flat, -2.5)
