"""Slow, obvious numpy versions of every kernel in :mod:`adam_dask.model.kernels`; tests only.

They return new arrays (no output buffers) and compute in float64, so a test can compare a kernel
with its reference and with finite differences. Shapes follow the legend in ``kernels.py``.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "batchnorm_backward",
    "batchnorm_forward",
    "batchnorm_infer",
    "conv2d_backward_input",
    "conv2d_backward_weights",
    "conv2d_forward",
    "dense_backward_input",
    "dense_backward_update",
    "dense_backward_weights",
    "dense_forward",
    "dropout_backward",
    "dropout_forward",
    "maxpool2_backward",
    "maxpool2_forward",
    "network_loss",
    "relu_backward",
    "relu_forward",
    "softmax_cross_entropy_backward",
    "softmax_cross_entropy_forward",
    "tanh_backward",
    "tanh_forward",
]


def conv2d_forward(x, w, bias):
    """x (B, C, H, W), w (OC, C, KH, KW), bias (OC,) -> (B, OC, OH, OW), valid, stride 1."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    B, C, H, W = x.shape
    OC, _, KH, KW = w.shape
    OH, OW = H - KH + 1, W - KW + 1
    out = np.zeros((B, OC, OH, OW))
    for oy in range(OH):
        for ox in range(OW):
            patch = x[:, :, oy : oy + KH, ox : ox + KW]  # (B, C, KH, KW)
            out[:, :, oy, ox] = np.einsum("bckl,ockl->bo", patch, w)
    return out + np.asarray(bias, np.float64)[None, :, None, None]


def conv2d_backward_input(dout, w, H, W):
    """dout (B, OC, OH, OW), w (OC, C, KH, KW) -> dx (B, C, H, W)."""
    dout, w = np.asarray(dout, np.float64), np.asarray(w, np.float64)
    B, OC, OH, OW = dout.shape
    _, C, KH, KW = w.shape
    dx = np.zeros((B, C, H, W))
    for oy in range(OH):
        for ox in range(OW):
            dx[:, :, oy : oy + KH, ox : ox + KW] += np.einsum(
                "bo,ockl->bckl", dout[:, :, oy, ox], w
            )
    return dx


def conv2d_backward_weights(dout, x, KH, KW):
    """dout (B, OC, OH, OW), x (B, C, H, W) -> (dw (OC, C, KH, KW), dbias (OC,))."""
    dout, x = np.asarray(dout, np.float64), np.asarray(x, np.float64)
    B, OC, OH, OW = dout.shape
    C = x.shape[1]
    dw = np.zeros((OC, C, KH, KW))
    for oy in range(OH):
        for ox in range(OW):
            dw += np.einsum(
                "bo,bckl->ockl", dout[:, :, oy, ox], x[:, :, oy : oy + KH, ox : ox + KW]
            )
    return dw, dout.sum(axis=(0, 2, 3))


def maxpool2_forward(x):
    """x (B, C, H, W) -> (out (B, C, H//2, W//2), argmax int8 0..3 = dy*2+dx); first max wins."""
    x = np.asarray(x)
    B, C, H, W = x.shape
    PH, PW = H // 2, W // 2
    win = x[:, :, : 2 * PH, : 2 * PW].reshape(B, C, PH, 2, PW, 2).transpose(0, 1, 2, 4, 3, 5)
    win = win.reshape(B, C, PH, PW, 4)
    return win.max(axis=-1), win.argmax(axis=-1).astype(np.int8)


def maxpool2_backward(dout, argmax, H, W):
    """dout (B, C, PH, PW), argmax -> dx (B, C, H, W)."""
    B, C, PH, PW = dout.shape
    dx = np.zeros((B, C, H, W))
    for py in range(PH):
        for px in range(PW):
            a = argmax[:, :, py, px]
            for k in range(4):
                sel = a == k
                dx[:, :, 2 * py + k // 2, 2 * px + k % 2] += np.where(sel, dout[:, :, py, px], 0.0)
    return dx


def dense_forward(x, w, bias):
    """x (B, I), w (O, I), bias (O,) -> (B, O)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + np.asarray(bias, np.float64)


def dense_backward_input(dout, w):
    """dout (B, O), w (O, I) -> dx (B, I)."""
    return np.asarray(dout, np.float64) @ np.asarray(w, np.float64)


def dense_backward_weights(dout, x):
    """dout (B, O), x (B, I) -> (dw (O, I), dbias (O,))."""
    dout = np.asarray(dout, np.float64)
    return dout.T @ np.asarray(x, np.float64), dout.sum(axis=0)


def dense_backward_update(dout, x, w, bias, lr, momentum=0.0, vw=None, vb=None):
    """The dense layer's backward pass and SGD update (``fused.dense_backward_update``):
    dout (B, O), x (B, I), w (O, I), bias (O,) -> (dx (B, I) from the old weights, new w, new
    bias, new vw, new vb); ``u = momentum * v - lr * grad`` is added to the weights and becomes
    the velocity (vw, vb zero when None)."""
    dout, x = np.asarray(dout, np.float64), np.asarray(x, np.float64)
    w, bias = np.asarray(w, np.float64), np.asarray(bias, np.float64)
    dx = dense_backward_input(dout, w)
    dw, db = dense_backward_weights(dout, x)
    vw = np.zeros_like(w) if vw is None else np.asarray(vw, np.float64)
    vb = np.zeros_like(bias) if vb is None else np.asarray(vb, np.float64)
    uw, ub = momentum * vw - lr * dw, momentum * vb - lr * db
    return dx, w + uw, bias + ub, uw, ub


def network_loss(layers, params, x, labels, activation, masks=None, p=0.0, smoothing=0.0):
    """The mean softmax cross-entropy of a network's layer plan (``Network.layers``) with the
    parameters ``params`` (name -> array, e.g. ``layout.views(flat)``) on images x (B, C, H, W),
    in float64 and the textbook order (conv -> [bn ->] act -> pool; batch normalisation with the
    mini-batch's statistics, as in training). ``masks``: layer index -> 0/1 array of that
    layer's output shape, the dropout applied after its activation (rate ``p``).
    ``smoothing``: label smoothing of the target (:func:`softmax_cross_entropy_forward`)."""
    act = tanh_forward if activation == "tanh" else relu_forward
    h = np.asarray(x, np.float64)
    for j, L in enumerate(layers):
        i = L.index
        if L.kind == "conv":
            h = conv2d_forward(h, params[f"{i}.weight"], params[f"{i}.bias"])
        elif L.kind == "maxpool":
            h = maxpool2_forward(h)[0]
        elif L.kind == "bn":
            h = batchnorm_forward(h, params[f"{i}.weight"], params[f"{i}.bias"])
        else:
            h = dense_forward(h.reshape(len(h), -1), params[f"{i}.weight"], params[f"{i}.bias"])
        normalised_next = j + 1 < len(layers) and layers[j + 1].kind == "bn"
        if L is not layers[-1] and L.kind != "maxpool" and not normalised_next:
            h = act(h)
        if masks is not None and i in masks:
            h = dropout_forward(h, masks[i], p)
    return softmax_cross_entropy_forward(h, labels, smoothing)[1]


def _channels(x):
    """x (B, C, ...) as float64 (B, C, P)."""
    x = np.asarray(x, np.float64)
    return x.reshape(x.shape[0], x.shape[1], -1)


def batchnorm_forward(x, gamma, beta, eps=1e-5):
    """x (B, C, ...) -> the same shape, each channel normalised by the batch's mean and biased
    variance over its B*P values, then scaled by gamma (C,) and shifted by beta (C,)."""
    x3 = _channels(x)
    return batchnorm_infer(x, x3.mean(axis=(0, 2)), x3.var(axis=(0, 2)), gamma, beta, eps)


def batchnorm_infer(x, mean, var, gamma, beta, eps=1e-5):
    """x (B, C, ...) normalised by fixed per-channel statistics mean (C,) and var (C,)."""
    x3 = _channels(x)
    m = np.asarray(mean, np.float64)[None, :, None]
    v = np.asarray(var, np.float64)[None, :, None]
    g = np.asarray(gamma, np.float64)[None, :, None]
    b = np.asarray(beta, np.float64)[None, :, None]
    return (g * (x3 - m) / np.sqrt(v + eps) + b).reshape(np.shape(x))


def batchnorm_backward(dout, x, gamma, eps=1e-5):
    """The gradient through :func:`batchnorm_forward`: dout, x (B, C, ...) -> (dx like x,
    dgamma (C,), dbeta (C,)), the textbook chain rule through the mean and the variance."""
    x3, d3 = _channels(x), _channels(dout)
    n = x3.shape[0] * x3.shape[2]
    mean = x3.mean(axis=(0, 2), keepdims=True)
    var = x3.var(axis=(0, 2), keepdims=True)
    g = np.asarray(gamma, np.float64)[None, :, None]
    xc = x3 - mean
    invstd = 1.0 / np.sqrt(var + eps)
    dxhat = d3 * g
    dvar = (dxhat * xc).sum(axis=(0, 2), keepdims=True) * -0.5 * invstd**3
    dmean = -(dxhat * invstd).sum(axis=(0, 2), keepdims=True) - 2.0 * dvar * xc.mean(
        axis=(0, 2), keepdims=True
    )
    dx = dxhat * invstd + dvar * 2.0 * xc / n + dmean / n
    dgamma = (d3 * xc * invstd).sum(axis=(0, 2))
    return dx.reshape(np.shape(x)), dgamma, d3.sum(axis=(0, 2))


def dropout_forward(y, mask, p):
    """y * mask / (1 - p): inverted dropout with a given 0/1 mask."""
    return np.asarray(y, np.float64) * np.asarray(mask, np.float64) / (1.0 - p)


def dropout_backward(dy, mask, p):
    return np.asarray(dy, np.float64) * np.asarray(mask, np.float64) / (1.0 - p)


def tanh_forward(z):
    return np.tanh(np.asarray(z, np.float64))


def tanh_backward(dy, y):
    return np.asarray(dy, np.float64) * (1.0 - np.asarray(y, np.float64) ** 2)


def relu_forward(z):
    return np.maximum(np.asarray(z, np.float64), 0.0)


def relu_backward(dy, y):
    return np.where(np.asarray(y) > 0, np.asarray(dy, np.float64), 0.0)


def softmax_cross_entropy_forward(logits, labels, smoothing=0.0):
    """logits (B, K), labels (B,) -> (probs (B, K), mean loss), the cross-entropy against the
    smoothed target (1 - smoothing) * onehot + smoothing / K."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    p = np.exp(logp)
    target = np.full(p.shape, smoothing / p.shape[1])
    target[np.arange(len(labels)), labels] += 1.0 - smoothing
    loss = -(target * logp).sum(axis=1).mean()
    return p, float(loss)


def softmax_cross_entropy_backward(probs, labels, smoothing=0.0):
    """-> dlogits (B, K) of the mean loss: (probs - target) / B."""
    d = np.array(probs, np.float64) - smoothing / probs.shape[1]
    d[np.arange(len(labels)), labels] -= 1.0 - smoothing
    return d / len(labels)
