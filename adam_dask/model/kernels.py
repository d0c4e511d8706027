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

# Reassociation lets LLVM vectorise the float32 reductions (dot products); no nnan/ninf, so
# NaN and inf propagate as usual and a diverging model stays visible.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


def _kernel(fn):
    return njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")(fn)


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
    for b in range(B):
        o2 = out[b].reshape(OC, P)
        cb = cols[b]
        for oc in range(OC):
            row = o2[oc]
            bv = bias[oc]
            for p in range(P):
                row[p] = bv
            for k in range(CKK):
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
    for b in range(B):
        d2 = dout[b].reshape(OC, P)
        for k in range(CKK):
            row = dcols[k]
            for p in range(P):
                row[p] = 0.0
            for oc in range(OC):
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
    for b in range(B):
        d2 = dout[b].reshape(OC, P)
        cb = cols[b]
        for oc in range(OC):
            dr = d2[oc]
            s = 0.0
            for p in range(P):
                s += dr[p]
            dbias[oc] += s
            for k in range(CKK):
                ck = cb[k]
                s = np.float32(0.0)
                for p in range(P):
                    s += dr[p] * ck[p]
                dw2[oc, k] += s


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
    for o in range(O):
        wr = w[o]
        for b in range(B):
            xr = x[b]
            s = np.float32(0.0)
            for i in range(I):
                s += xr[i] * wr[i]
            out[b, o] = s + bias[o]


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
    """Both dense gradients in one pass over w and dw (cache-friendly): dx (B, I) = dout @ w
    (overwritten; skipped when not need_dx), dw (O, I) += dout.T @ x, dbias (O,) += dout.sum(0)."""
    B, I = x.shape
    O = w.shape[0]
    if need_dx:
        for b in range(B):
            for i in range(I):
                dx[b, i] = 0.0
    for o in range(O):
        wr = w[o]
        dr = dw[o]
        s = np.float32(0.0)
        for b in range(B):
            g = dout[b, o]
            s += g
            xr = x[b]
            for i in range(I):
                dr[i] += g * xr[i]
            if need_dx:
                dxr = dx[b]
                for i in range(I):
                    dxr[i] += g * wr[i]
        dbias[o] += s


# -- activations, in place: forward y = f(z), backward dz = dy * f'(z) written from y ------------

@_kernel
def tanh_forward(y):
    """y (any shape) <- tanh(y), in place."""
    f = y.reshape(-1)
    for i in range(f.size):
        f[i] = math.tanh(f[i])


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


# -- softmax cross-entropy ---------------------------------------------------------------------------

@_kernel
def softmax_cross_entropy_forward(probs, losses, logits, labels):
    """probs (B, K) = softmax(logits (B, K)); losses (B,) = -log probs[b, labels[b]];
    returns the mean loss (float64)."""
    B, K = logits.shape
    total = 0.0
    for b in range(B):
        m = logits[b, 0]
        for k in range(1, K):
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
        loss = math.log(s) + m - logits[b, labels[b]]
        losses[b] = loss
        total += loss
    return total / B


@_kernel
def softmax_cross_entropy_backward(dlogits, probs, labels, scale):
    """dlogits (B, K) = (probs - onehot(labels)) * scale; scale = 1/B for a mean loss."""
    B, K = probs.shape
    for b in range(B):
        for k in range(K):
            dlogits[b, k] = probs[b, k] * scale
        dlogits[b, labels[b]] -= scale


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
