"""numba kernels of the training engine: paired ``*_forward`` / ``*_backward`` functions.

Every kernel is ``@njit(nogil=True, cache=True)``: it releases the GIL for the whole call, so the
Hogwild threads of a replica run them concurrently, and worker processes load the compiled code
from ``NUMBA_CACHE_DIR``. Conventions (after llm.c):

* outputs (and scratch buffers that a later kernel reads) come first, inputs after;
* the caller allocates every buffer once (a replica's per-thread context), so no kernel
  allocates: the hot loop allocates nothing;
* weight-gradient kernels *accumulate* (``dw += ...``); zero them before a batch (``sgd_update``
  does it while it applies them); input-gradient kernels *overwrite* ``dx``;
* every array is C-contiguous float32 (``argmax`` int8, labels int64); shapes and dtypes are
  checked by :mod:`adam_dask.model.network` before any kernel runs, never here.

Shape legend::

    B  = batch (images)              C  = input channels      H, W   = input height, width
    OC = output channels (filters)   KH, KW = kernel size     OH = H-KH+1, OW = W-KW+1 (valid)
    CKK = C*KH*KW (one patch)        P  = OH*OW (patches)     PH = H//2, PW = W//2 (2x2 pooling)
    I  = dense inputs                O  = dense outputs       K  = classes
    N  = B*P, the values batch normalisation pools per channel (P = 1 after a dense layer)

Convolution is im2col + a hand-written matrix product (no BLAS: numba's ``np.dot`` needs scipy,
and a BLAS call per small image costs more than it saves here). ``cols`` (B, CKK, P) holds the
patches; the forward pass fills it and the weight gradient reads it back, so it is built once.
Row ``k = (c*KH + ky)*KW + kx`` of ``cols`` matches ``w.reshape(OC, CKK)``: torch's
``(out, in, kh, kw)`` layout.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from numba import njit

logger = logging.getLogger(__name__)

__all__ = [
    "batchnorm_backward",
    "batchnorm_forward",
    "batchnorm_infer",
    "conv2d_backward_input",
    "conv2d_backward_weights",
    "conv2d_forward",
    "dense_backward",
    "dense_backward_input",
    "dense_backward_weights",
    "dense_forward",
    "dropout_backward",
    "dropout_forward",
    "im2col",
    "maxpool2_backward",
    "maxpool2_forward",
    "relu_backward",
    "relu_forward",
    "sgd_update",
    "softmax_cross_entropy_backward",
    "softmax_cross_entropy_forward",
    "tanh_backward",
    "tanh_forward",
]

# Reassociation lets LLVM vectorise the float32 reductions (dot products); no nnan/ninf, so
# NaN and inf propagate as usual and a diverging model stays visible.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


def _kernel(fn):
    return njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")(fn)


@_kernel
def _dot(a, b):
    """sum(a * b) of two 1-D float32 arrays."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


# -- 2-D convolution (valid, stride 1) ------------------------------------------------------------


@_kernel
def im2col(cols, x, KH, KW):
    """cols (B, CKK, P) <- the KHxKW patches of x (B, C, H, W)."""
    B, C, H, W = x.shape
    OH = H - KH + 1
    OW = W - KW + 1
    for b in range(B):
        for c in range(C):
            for ky in range(KH):
                for kx in range(KW):
                    k = (c * KH + ky) * KW + kx
                    for oy in range(OH):
                        p0 = oy * OW
                        for ox in range(OW):
                            cols[b, k, p0 + ox] = x[b, c, oy + ky, ox + kx]


@_kernel
def conv2d_forward(out, cols, x, w, bias):
    """out (B, OC, OH, OW) = conv(x (B, C, H, W), w (OC, C, KH, KW)) + bias (OC,);
    also fills cols (B, CKK, P), which conv2d_backward_weights reads."""
    B = x.shape[0]
    OC, C, KH, KW = w.shape
    OH, OW = out.shape[2], out.shape[3]
    P = OH * OW
    CKK = C * KH * KW
    im2col(cols, x, KH, KW)
    w2 = w.reshape(OC, CKK)
    K4 = CKK - CKK % 4
    for b in range(B):
        o2 = out[b].reshape(OC, P)
        cb = cols[b]
        for oc in range(OC):
            row = o2[oc]
            bv = bias[oc]
            for p in range(P):
                row[p] = bv
            # four patch rows per pass: one load and store of row per four multiply-adds
            for k in range(0, K4, 4):
                w0, w1, w2_, w3 = w2[oc, k], w2[oc, k + 1], w2[oc, k + 2], w2[oc, k + 3]
                c0, c1, c2, c3 = cb[k], cb[k + 1], cb[k + 2], cb[k + 3]
                for p in range(P):
                    row[p] += w0 * c0[p] + w1 * c1[p] + w2_ * c2[p] + w3 * c3[p]
            for k in range(K4, CKK):
                wv = w2[oc, k]
                ck = cb[k]
                for p in range(P):
                    row[p] += wv * ck[p]


@_kernel
def conv2d_backward_input(dx, dcols, dout, w):
    """dx (B, C, H, W) = gradient wrt the input, from dout (B, OC, OH, OW) and w (OC, C, KH, KW);
    dcols (CKK, P) is scratch. Overwrites dx."""
    B, C, H, W = dx.shape
    OC, _, KH, KW = w.shape
    OH, OW = dout.shape[2], dout.shape[3]
    P = OH * OW
    CKK = C * KH * KW
    w2 = w.reshape(OC, CKK)
    O4 = OC - OC % 4
    for b in range(B):
        d2 = dout[b].reshape(OC, P)
        for k in range(CKK):
            row = dcols[k]
            for p in range(P):
                row[p] = 0.0
            for oc in range(0, O4, 4):
                w0, w1, w2_, w3 = w2[oc, k], w2[oc + 1, k], w2[oc + 2, k], w2[oc + 3, k]
                e0, e1, e2, e3 = d2[oc], d2[oc + 1], d2[oc + 2], d2[oc + 3]
                for p in range(P):
                    row[p] += w0 * e0[p] + w1 * e1[p] + w2_ * e2[p] + w3 * e3[p]
            for oc in range(O4, OC):
                wv = w2[oc, k]
                dr = d2[oc]
                for p in range(P):
                    row[p] += wv * dr[p]
        xb = dx[b]
        for c in range(C):
            for y in range(H):
                for xx in range(W):
                    xb[c, y, xx] = 0.0
        for c in range(C):
            for ky in range(KH):
                for kx in range(KW):
                    row = dcols[(c * KH + ky) * KW + kx]
                    for oy in range(OH):
                        p0 = oy * OW
                        for ox in range(OW):
                            xb[c, oy + ky, ox + kx] += row[p0 + ox]


@_kernel
def conv2d_backward_weights(dw, dbias, dout, cols):
    """dw (OC, C, KH, KW) += and dbias (OC,) += the gradients wrt weights and bias, from
    dout (B, OC, OH, OW) and the patches cols (B, CKK, P) that conv2d_forward filled."""
    OC = dw.shape[0]
    B, CKK, P = cols.shape
    dw2 = dw.reshape(OC, CKK)
    O2 = OC - OC % 2
    K2 = CKK - CKK % 2
    for b in range(B):
        d2 = dout[b].reshape(OC, P)
        cb = cols[b]
        for oc in range(OC):
            dr = d2[oc]
            s = np.float32(0.0)
            for p in range(P):
                s += dr[p]
            dbias[oc] += s
        # 2x2 blocks of dot products: four multiply-adds per four loads
        for oc in range(0, O2, 2):
            e0, e1 = d2[oc], d2[oc + 1]
            for k in range(0, K2, 2):
                c0, c1 = cb[k], cb[k + 1]
                s00 = s01 = s10 = s11 = np.float32(0.0)
                for p in range(P):
                    s00 += e0[p] * c0[p]
                    s01 += e0[p] * c1[p]
                    s10 += e1[p] * c0[p]
                    s11 += e1[p] * c1[p]
                dw2[oc, k] += s00
                dw2[oc, k + 1] += s01
                dw2[oc + 1, k] += s10
                dw2[oc + 1, k + 1] += s11
            for k in range(K2, CKK):
                dw2[oc, k] += _dot(e0, cb[k])
                dw2[oc + 1, k] += _dot(e1, cb[k])
        for oc in range(O2, OC):
            for k in range(CKK):
                dw2[oc, k] += _dot(d2[oc], cb[k])


# -- 2x2 max-pooling (stride 2; an odd last row/column is dropped, as torch's floor mode) -------


@_kernel
def maxpool2_forward(out, argmax, x):
    """out (B, C, PH, PW) = 2x2 max of x (B, C, H, W); argmax (B, C, PH, PW) int8 keeps which of
    the four (0..3 = dy*2+dx) won, for the backward pass."""
    B, C, PH, PW = out.shape
    for b in range(B):
        for c in range(C):
            for py in range(PH):
                y0 = 2 * py
                for px in range(PW):
                    x0 = 2 * px
                    m = x[b, c, y0, x0]
                    a = 0
                    v = x[b, c, y0, x0 + 1]
                    if v > m:
                        m = v
                        a = 1
                    v = x[b, c, y0 + 1, x0]
                    if v > m:
                        m = v
                        a = 2
                    v = x[b, c, y0 + 1, x0 + 1]
                    if v > m:
                        m = v
                        a = 3
                    out[b, c, py, px] = m
                    argmax[b, c, py, px] = a


@_kernel
def maxpool2_backward(dx, dout, argmax):
    """dx (B, C, H, W) = dout (B, C, PH, PW) routed to the winners in argmax; overwrites dx."""
    B, C, H, W = dx.shape
    PH, PW = dout.shape[2], dout.shape[3]
    for b in range(B):
        for c in range(C):
            for y in range(H):
                for xx in range(W):
                    dx[b, c, y, xx] = 0.0
            for py in range(PH):
                for px in range(PW):
                    a = argmax[b, c, py, px]
                    dx[b, c, 2 * py + a // 2, 2 * px + a % 2] = dout[b, c, py, px]


# -- dense (fully connected) layers: torch's nn.Linear layout, w (O, I) ---------------------------


@_kernel
def dense_forward(out, x, w, bias):
    """out (B, O) = x (B, I) @ w.T (I, O) + bias (O,)."""
    B, I = x.shape
    O = w.shape[0]
    O2 = O - O % 2
    B2 = B - B % 2
    # 2x2 blocks of dot products: four multiply-adds per four loads
    for o in range(0, O2, 2):
        w0, w1 = w[o], w[o + 1]
        for b in range(0, B2, 2):
            x0, x1 = x[b], x[b + 1]
            s00 = s01 = s10 = s11 = np.float32(0.0)
            for i in range(I):
                s00 += x0[i] * w0[i]
                s01 += x0[i] * w1[i]
                s10 += x1[i] * w0[i]
                s11 += x1[i] * w1[i]
            out[b, o] = s00 + bias[o]
            out[b, o + 1] = s01 + bias[o + 1]
            out[b + 1, o] = s10 + bias[o]
            out[b + 1, o + 1] = s11 + bias[o + 1]
        for b in range(B2, B):
            out[b, o] = _dot(x[b], w0) + bias[o]
            out[b, o + 1] = _dot(x[b], w1) + bias[o + 1]
    for o in range(O2, O):
        for b in range(B):
            out[b, o] = _dot(x[b], w[o]) + bias[o]


@_kernel
def dense_backward_input(dx, dout, w):
    """dx (B, I) = dout (B, O) @ w (O, I); overwrites dx."""
    B, I = dx.shape
    O = w.shape[0]
    for b in range(B):
        for i in range(I):
            dx[b, i] = 0.0
    for o in range(O):
        wr = w[o]
        for b in range(B):
            g = dout[b, o]
            xr = dx[b]
            for i in range(I):
                xr[i] += g * wr[i]


@_kernel
def dense_backward_weights(dw, dbias, dout, x):
    """dw (O, I) += dout.T (O, B) @ x (B, I); dbias (O,) += dout.sum(0)."""
    B, I = x.shape
    O = dw.shape[0]
    for o in range(O):
        dr = dw[o]
        s = np.float32(0.0)
        for b in range(B):
            g = dout[b, o]
            s += g
            xr = x[b]
            for i in range(I):
                dr[i] += g * xr[i]
        dbias[o] += s


@_kernel
def dense_backward(dx, dw, dbias, dout, x, w, need_dx):
    """Both dense gradients, blocked for few stores: dx (B, I) = dout @ w (overwritten; skipped
    when not need_dx), dw (O, I) += dout.T @ x, dbias (O,) += dout.sum(0)."""
    B, I = x.shape
    O = w.shape[0]
    B4 = B - B % 4
    O4 = O - O % 4
    for o in range(O):
        dr = dw[o]
        s = np.float32(0.0)
        for b in range(B):
            s += dout[b, o]
        dbias[o] += s
        # four images per pass over the weight-gradient row
        for b in range(0, B4, 4):
            g0, g1, g2, g3 = dout[b, o], dout[b + 1, o], dout[b + 2, o], dout[b + 3, o]
            x0, x1, x2, x3 = x[b], x[b + 1], x[b + 2], x[b + 3]
            for i in range(I):
                dr[i] += g0 * x0[i] + g1 * x1[i] + g2 * x2[i] + g3 * x3[i]
        for b in range(B4, B):
            g = dout[b, o]
            xr = x[b]
            for i in range(I):
                dr[i] += g * xr[i]
    if not need_dx:
        return
    for b in range(B):
        dxr = dx[b]
        for i in range(I):
            dxr[i] = 0.0
        # four weight rows per pass over the input-gradient row
        for o in range(0, O4, 4):
            g0, g1, g2, g3 = dout[b, o], dout[b, o + 1], dout[b, o + 2], dout[b, o + 3]
            w0, w1, w2, w3 = w[o], w[o + 1], w[o + 2], w[o + 3]
            for i in range(I):
                dxr[i] += g0 * w0[i] + g1 * w1[i] + g2 * w2[i] + g3 * w3[i]
        for o in range(O4, O):
            g = dout[b, o]
            wr = w[o]
            for i in range(I):
                dxr[i] += g * wr[i]


# -- activations, in place: forward y = f(z), backward dz = dy * f'(z) written from y ------------


@_kernel
def tanh_forward(y):
    """y (any shape) <- tanh(y), in place. A clamped rational approximation (the one Eigen
    uses for float32, max error 4e-7) that vectorises, unlike libm's tanh."""
    f = y.reshape(-1)
    for i in range(f.size):
        v = min(max(f[i], np.float32(-7.90531110763549805)), np.float32(7.90531110763549805))
        v2 = v * v
        p = v2 * np.float32(-2.76076847742355e-16) + np.float32(2.00018790482477e-13)
        p = p * v2 + np.float32(-8.60467152213735e-11)
        p = p * v2 + np.float32(5.12229709037114e-08)
        p = p * v2 + np.float32(1.48572235717979e-05)
        p = p * v2 + np.float32(6.37261928875436e-04)
        p = p * v2 + np.float32(4.89352455891786e-03)
        q = v2 * np.float32(1.19825839466702e-06) + np.float32(1.18534705686654e-04)
        q = q * v2 + np.float32(2.26843463243900e-03)
        q = q * v2 + np.float32(4.89352518554385e-03)
        f[i] = v * p / q


@_kernel
def tanh_backward(dy, y):
    """dy <- dy * (1 - y**2), in place; y is the forward output."""
    d = dy.reshape(-1)
    v = y.reshape(-1)
    for i in range(d.size):
        d[i] *= 1.0 - v[i] * v[i]


@_kernel
def relu_forward(y):
    """y (any shape) <- max(y, 0), in place."""
    f = y.reshape(-1)
    for i in range(f.size):
        if f[i] < 0.0:
            f[i] = 0.0


@_kernel
def relu_backward(dy, y):
    """dy <- dy * (y > 0), in place; y is the forward output."""
    d = dy.reshape(-1)
    v = y.reshape(-1)
    for i in range(d.size):
        if v[i] <= 0.0:
            d[i] = 0.0


# -- batch normalisation (per channel over the batch and the positions; x is (B, C, P)) -------------

#: The variance floor of batch normalisation (torch's default).
BN_EPS = 1e-5


@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _bn_channel(out, x, c, mean, invstd, gamma, beta):
    """out[:, c] = gamma * (x[:, c] - mean) * invstd + beta, as one multiply-add per value."""
    g = np.float32(gamma * invstd)
    h = np.float32(beta - mean * gamma * invstd)
    for b in range(x.shape[0]):
        for p in range(x.shape[2]):
            out[b, c, p] = x[b, c, p] * g + h


@_kernel
def batchnorm_forward(out, stats, x, gamma, beta, eps):
    """Training mode: out (B, C, P) = gamma * (x - mean) * invstd + beta with the mean and
    biased variance of each channel over the mini-batch's B*P values, invstd = 1/sqrt(var +
    eps); stats (2, C) <- (mean, invstd), which :func:`batchnorm_backward` reads. Sums in
    float64 (two passes), so a large mean does not swamp the variance."""
    B, C, P = x.shape
    inv_n = 1.0 / (B * P)
    for c in range(C):
        s = 0.0
        for b in range(B):
            for p in range(P):
                s += x[b, c, p]
        mean = s * inv_n
        v = 0.0
        for b in range(B):
            for p in range(P):
                d = x[b, c, p] - mean
                v += d * d
        invstd = 1.0 / math.sqrt(v * inv_n + eps)
        stats[0, c] = mean
        stats[1, c] = invstd
        _bn_channel(out, x, c, mean, invstd, gamma[c], beta[c])


@_kernel
def batchnorm_infer(out, x, mean, var, gamma, beta, eps):
    """Inference mode: out (B, C, P) = gamma * (x - mean) / sqrt(var + eps) + beta with fixed
    statistics mean (C,) and var (C,) (the population's, ``Network.calibrate``)."""
    for c in range(x.shape[1]):
        _bn_channel(out, x, c, mean[c], 1.0 / math.sqrt(var[c] + eps), gamma[c], beta[c])


@_kernel
def batchnorm_backward(dx, dgamma, dbeta, dout, x, stats, gamma):
    """The gradient through :func:`batchnorm_forward` (the batch statistics depend on x):
    with xhat = (x - mean) * invstd, dgamma (C,) += sum(dout * xhat), dbeta (C,) += sum(dout),
    and dx (B, C, P) = gamma * invstd * (dout - mean(dout) - xhat * mean(dout * xhat)) over
    each channel's B*P values (overwrites dx; dx may not alias dout or x)."""
    B, C, P = x.shape
    inv_n = 1.0 / (B * P)
    for c in range(C):
        mean = stats[0, c]
        invstd = stats[1, c]
        sd = 0.0
        sdx = 0.0
        for b in range(B):
            for p in range(P):
                d = dout[b, c, p]
                sd += d
                sdx += d * (x[b, c, p] - mean) * invstd
        dgamma[c] += sdx
        dbeta[c] += sd
        k = np.float32(gamma[c] * invstd)
        md = np.float32(sd * inv_n)
        mdx = np.float32(sdx * inv_n)
        for b in range(B):
            for p in range(P):
                xh = (x[b, c, p] - mean) * invstd
                dx[b, c, p] = k * (dout[b, c, p] - md - xh * mdx)


# -- inverted dropout (training only; relu layers: a dropped value is exactly 0) ----------------------


@_kernel
def dropout_forward(y, p, seed):
    """y (any shape), in place: each value zeroed with probability p, the others scaled by
    1 / (1 - p), so the expected output is unchanged and inference needs no rescaling. Draws come
    from this thread's numba generator; ``seed`` >= 0 reseeds it first (tests), -1 goes on."""
    if seed >= 0:
        np.random.seed(seed)
    f = y.reshape(-1)
    inv = np.float32(1.0 / (1.0 - p))
    for i in range(f.size):
        if np.random.random() < p:
            f[i] = 0.0
        else:
            f[i] *= inv


@_kernel
def dropout_backward(dy, y, p):
    """dy <- dy / (1 - p) where the forward output y is not 0, else 0, in place: the gradient
    through :func:`dropout_forward`, its mask read from y (exact after relu, whose own zeros
    have no gradient either)."""
    d = dy.reshape(-1)
    v = y.reshape(-1)
    inv = np.float32(1.0 / (1.0 - p))
    for i in range(d.size):
        if v[i] == 0.0:
            d[i] = 0.0
        else:
            d[i] *= inv


# -- softmax cross-entropy ---------------------------------------------------------------------------


@_kernel
def softmax_cross_entropy_forward(probs, losses, logits, labels, smoothing=0.0):
    """probs (B, K) = softmax(logits (B, K)); losses (B,) = the cross-entropy against the target
    (1 - smoothing) * onehot(labels) + smoothing / K, that is
    (1 - smoothing) * -log probs[b, labels[b]] + smoothing * mean_k(-log probs[b, k])
    (smoothing 0: -log probs[b, labels[b]]); returns the mean loss (float64)."""
    B, K = logits.shape
    total = 0.0
    for b in range(B):
        m = logits[b, 0]
        zsum = 0.0
        for k in range(K):
            zsum += logits[b, k]
            if logits[b, k] > m:
                m = logits[b, k]
        s = 0.0
        for k in range(K):
            e = math.exp(logits[b, k] - m)
            probs[b, k] = e
            s += e
        inv = 1.0 / s
        for k in range(K):
            probs[b, k] *= inv
        lse = math.log(s) + m
        loss = (1.0 - smoothing) * (lse - logits[b, labels[b]]) + smoothing * (lse - zsum / K)
        losses[b] = loss
        total += loss
    return total / B


@_kernel
def softmax_cross_entropy_backward(dlogits, probs, labels, scale, smoothing=0.0):
    """dlogits (B, K) = (probs - (1 - smoothing) * onehot(labels) - smoothing / K) * scale, the
    gradient of :func:`softmax_cross_entropy_forward`'s loss; scale = 1/B for a mean loss."""
    B, K = probs.shape
    off = np.float32(smoothing / K) * scale
    hit = np.float32(1.0 - smoothing) * scale
    for b in range(B):
        for k in range(K):
            dlogits[b, k] = probs[b, k] * scale - off
        dlogits[b, labels[b]] -= hit


# -- the update ------------------------------------------------------------------------------------------


@_kernel
def sgd_update(flat, grad, velocity, lr, momentum):
    """flat (N,) += u, u = momentum * velocity - lr * grad (velocity <- u when momentum > 0);
    zeroes grad (N,) for the next batch. Lock-free: other threads may update flat meanwhile."""
    n = flat.shape[0]
    lr = np.float32(lr)
    momentum = np.float32(momentum)
    if momentum > 0.0:
        for i in range(n):
            u = momentum * velocity[i] - lr * grad[i]
            velocity[i] = u
            flat[i] += u
            grad[i] = 0.0
    else:
        for i in range(n):
            flat[i] -= lr * grad[i]
            grad[i] = 0.0
