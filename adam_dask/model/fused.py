"""The fused mini-batch step: forward, backward and SGD update of a whole network in one numba call.

The layer-by-layer path (:meth:`Network.backward_into` then :func:`kernels.sgd_update`) makes
about 20 kernel calls per mini-batch from Python and holds the GIL between them, which caps how
well a replica's Hogwild threads scale. :func:`train_step` walks the network's plan (an int64
table, one row per layer, built by :class:`~adam_dask.model.context.Context`) inside numba and
calls the same kernels, so a thread takes the GIL once per mini-batch to enter, and releases it
for the whole step.

The update is applied layer by layer during the backward pass, right after a layer's gradients
are known and its input gradient has been computed with the old weights; the result equals the
unfused step's (``flat += momentum * v - lr * grad`` over every parameter), up to float rounding.

* conv layers accumulate their gradient in ``grad`` and apply it with :func:`kernels.sgd_update`
  on their slice (which zeroes it again);
* dense layers use :func:`dense_backward_update`, which never writes a gradient buffer: it builds
  one weight-gradient row at a time in a small scratch row (L1-resident) and applies it to the
  weights at once. For large dense layers this halves the memory traffic of the step (no full
  gradient written, read back and zeroed).

Shapes follow the legend of :mod:`adam_dask.model.kernels`; every buffer is flat float32 and
C-contiguous (argmax int8, labels int64), sized by the Context; nothing here checks shapes.

numba's on-disk cache of :func:`train_step` is keyed by this file alone: after a change to a
kernel in ``kernels.py``, delete ``adam_dask/model/__pycache__/fused.*.nb[ic]`` (or touch this
file), or the cached step keeps the old kernel.
"""

from __future__ import annotations

import logging

import numpy as np
from numba import njit

from . import kernels as K
from .checks import check_step
from .context import Context
from .kernels import _kernel
from .protocol import Trainable

logger = logging.getLogger(__name__)

__all__ = ["dense_backward_update", "forward_plan", "sgd_update_into", "step", "train_step"]

# plan columns (see context.PLAN_COLUMNS) and codes (context.KINDS, context.ACT_CODES)
_KIND, _ACT, _C, _H, _W, _OC, _OH, _OW, _KH, _KW = range(10)
_WOFF, _BOFF, _AOFF, _COFF, _DCOFF, _MOFF, _SOFF = range(10, 17)
_CONV, _POOL, _FC, _BN = 0, 1, 2, 3
_TANH, _RELU = 1, 2


@njit(nogil=True, cache=True, fastmath=K._FASTMATH, error_model="numpy", inline="always")
def _dense_row_update(w, bias, vw, vb, aw, ab, row, dout, x, o, t0, t1, lr, momentum):
    """Apply row o of the dense update on the columns [t0, t1) (and the bias when t0 == 0):
    g = dout[:, o] @ x[:, t0:t1] built in ``row``, u = momentum * v - lr * g (v <- u), w += u,
    and the accumulators += u unless they are empty."""
    B = x.shape[0]
    B4 = B - B % 4
    T = t1 - t0
    accumulate = ab.shape[0] > 0
    if t0 == 0:
        s = np.float32(0.0)
        for b in range(B):
            s += dout[b, o]
        if momentum > 0.0:
            u = momentum * vb[o] - lr * s
            vb[o] = u
        else:
            u = -lr * s
        bias[o] += u
        if accumulate:
            ab[o] += u
    for i in range(T):
        row[i] = 0.0
    for b in range(0, B4, 4):
        g0, g1, g2, g3 = dout[b, o], dout[b + 1, o], dout[b + 2, o], dout[b + 3, o]
        x0, x1, x2, x3 = x[b, t0:t1], x[b + 1, t0:t1], x[b + 2, t0:t1], x[b + 3, t0:t1]
        for i in range(T):
            row[i] += g0 * x0[i] + g1 * x1[i] + g2 * x2[i] + g3 * x3[i]
    for b in range(B4, B):
        g = dout[b, o]
        xr = x[b, t0:t1]
        for i in range(T):
            row[i] += g * xr[i]
    if momentum > 0.0:
        vr = vw[o, t0:t1]
        for i in range(T):
            u = momentum * vr[i] - lr * row[i]
            vr[i] = u
            row[i] = u
    else:
        for i in range(T):
            row[i] = -lr * row[i]
    wr = w[o, t0:t1]
    for i in range(T):
        wr[i] += row[i]
    if accumulate:
        ar = aw[o, t0:t1]
        for i in range(T):
            ar[i] += row[i]


@_kernel
def dense_backward_update(dx, w, bias, vw, vb, aw, ab, row, dout, x, lr, momentum, need_dx):
    """The backward pass and SGD update of a dense layer, in one pass over the weights and
    without a gradient buffer.

    dx (B, I) = dout (B, O) @ w (O, I) with the weights as they were (overwritten; skipped when
    not need_dx); the gradient g = dout.T @ x is applied as it is made: ``u = momentum * v -
    lr * g``, ``w += u``, ``v <- u`` (vw (O, I) and vb (O,) velocities, untouched and possibly
    empty when momentum == 0), and ``a += u`` into the accumulators aw (O, I), ab (O,) unless
    they are empty; the bias likewise with dout.sum(0). ``row`` (I,) is scratch.

    The columns go in tiles small enough that a tile of dx and of x (B x tile each) stays in L2
    while four weight rows at a time stream through: each weight is read and written once per
    call, where a loop over images would read all of w once per image."""
    B, I = x.shape
    O = w.shape[0]
    O4 = O - O % 4
    lr = np.float32(lr)
    momentum = np.float32(momentum)
    T = max(64, (8192 // max(B, 1)) // 16 * 16)
    for t0 in range(0, I, T):
        t1 = min(t0 + T, I)
        if need_dx:
            for b in range(B):
                for i in range(t0, t1):
                    dx[b, i] = 0.0
        for o in range(0, O4, 4):
            if need_dx:
                w0, w1, w2, w3 = w[o, t0:t1], w[o + 1, t0:t1], w[o + 2, t0:t1], w[o + 3, t0:t1]
                for b in range(B):
                    g0, g1, g2, g3 = dout[b, o], dout[b, o + 1], dout[b, o + 2], dout[b, o + 3]
                    dxr = dx[b, t0:t1]
                    for i in range(t1 - t0):
                        dxr[i] += g0 * w0[i] + g1 * w1[i] + g2 * w2[i] + g3 * w3[i]
            for k in range(4):
                _dense_row_update(
                    w, bias, vw, vb, aw, ab, row, dout, x, o + k, t0, t1, lr, momentum
                )
        for o in range(O4, O):
            if need_dx:
                wr = w[o, t0:t1]
                for b in range(B):
                    g = dout[b, o]
                    dxr = dx[b, t0:t1]
                    for i in range(t1 - t0):
                        dxr[i] += g * wr[i]
            _dense_row_update(w, bias, vw, vb, aw, ab, row, dout, x, o, t0, t1, lr, momentum)


@_kernel
def sgd_update_into(flat, acc, grad, velocity, lr, momentum):
    """:func:`kernels.sgd_update` that also adds each update to ``acc`` (N,) unless it is empty:
    flat += u and acc += u, u = momentum * velocity - lr * grad (velocity <- u when momentum > 0);
    zeroes grad (N,)."""
    n = flat.shape[0]
    lr = np.float32(lr)
    momentum = np.float32(momentum)
    accumulate = acc.shape[0] > 0
    for i in range(n):
        if momentum > 0.0:
            u = momentum * velocity[i] - lr * grad[i]
            velocity[i] = u
        else:
            u = -lr * grad[i]
        flat[i] += u
        if accumulate:
            acc[i] += u
        grad[i] = 0.0


@njit(nogil=True, cache=True, inline="always")
def _drops(dropout, kind, j, L):
    """Whether layer ``j`` of ``L`` goes through dropout: a hidden dense layer, rate > 0 (the
    output layer feeds the softmax and is never dropped)."""
    return dropout > 0.0 and kind == _FC and j < L - 1


@_kernel
def forward_plan(plan, flat, x, n, acts, cols, argmax, stats, dropout=0.0, seed=-1):
    """Forward x (n * C*H*W values of the first layer's input, flat) through every layer of
    ``plan`` with the weights in ``flat``, as in training; each layer's output lands in its
    region of ``acts`` (also fills the conv patches ``cols``, pooling winners ``argmax`` and
    the batch statistics of the bn layers ``stats`` that the backward reads).
    ``dropout`` > 0: the hidden dense layers' outputs go through :func:`kernels.dropout_forward`
    after their activation (``seed`` >= 0 reseeds the thread's generator first)."""
    if dropout > 0.0 and seed >= 0:
        np.random.seed(seed)
    L = plan.shape[0]
    for j in range(L):
        p = plan[j]
        C, H, W = p[_C], p[_H], p[_W]
        OC, OH, OW = p[_OC], p[_OH], p[_OW]
        in_sz = C * H * W
        out_sz = OC * OH * OW
        if j == 0:
            src = x[: n * in_sz]
        else:
            q = plan[j - 1, _AOFF]
            src = acts[q : q + n * in_sz]
        a0 = p[_AOFF]
        dst = acts[a0 : a0 + n * out_sz]
        kind = p[_KIND]
        if kind == _CONV:
            KH, KW = p[_KH], p[_KW]
            ckk = C * KH * KW
            P = OH * OW
            w0, b0, c0 = p[_WOFF], p[_BOFF], p[_COFF]
            K.conv2d_forward(
                dst.reshape((n, OC, OH, OW)),
                cols[c0 : c0 + n * ckk * P].reshape((n, ckk, P)),
                src.reshape((n, C, H, W)),
                flat[w0 : w0 + OC * ckk].reshape((OC, C, KH, KW)),
                flat[b0 : b0 + OC],
            )
        elif kind == _POOL:
            m0 = p[_MOFF]
            K.maxpool2_forward(
                dst.reshape((n, OC, OH, OW)),
                argmax[m0 : m0 + n * out_sz].reshape((n, OC, OH, OW)),
                src.reshape((n, C, H, W)),
            )
        elif kind == _BN:
            w0, b0, s0 = p[_WOFF], p[_BOFF], p[_SOFF]
            K.batchnorm_forward(
                dst.reshape((n, OC, OH * OW)),
                stats[s0 : s0 + 2 * OC].reshape((2, OC)),
                src.reshape((n, OC, OH * OW)),
                flat[w0 : w0 + OC],
                flat[b0 : b0 + OC],
                K.BN_EPS,
            )
        else:
            w0, b0 = p[_WOFF], p[_BOFF]
            K.dense_forward(
                dst.reshape((n, OC)),
                src.reshape((n, in_sz)),
                flat[w0 : w0 + OC * in_sz].reshape((OC, in_sz)),
                flat[b0 : b0 + OC],
            )
        act = p[_ACT]
        if act == _TANH:
            K.tanh_forward(dst)
        elif act == _RELU:
            K.relu_forward(dst)
        if _drops(dropout, kind, j, L):
            K.dropout_forward(dst, dropout, -1)


@_kernel
def train_step(
    plan,
    flat,
    grad,
    velocity,
    acc,
    x,
    labels,
    n,
    acts,
    errs,
    cols,
    dcols,
    argmax,
    stats,
    probs,
    losses,
    row,
    lr,
    momentum,
    dropout=0.0,
    seed=-1,
    smoothing=0.0,
):
    """One SGD step on the mini-batch x[:n] (any shape, C-contiguous), labels[:n] (int64):
    forward, softmax cross-entropy (mean over the n images), backward, and the update
    ``flat += u, u = momentum * velocity - lr * grad`` (velocity <- u when momentum > 0;
    velocity like flat then, else unused), and ``acc += u`` unless ``acc`` is empty (a
    replica's accumulator of the updates for the parameter server). ``grad`` must be zero on
    entry and is zero on exit. ``dropout``: the rate on the hidden dense layers (relu only;
    ``seed`` as in :func:`forward_plan`). ``smoothing``: label smoothing of the cross-entropy's
    target (:func:`kernels.softmax_cross_entropy_forward`). Returns the mean loss (float64)."""
    xf = x.reshape(x.size)
    forward_plan(plan, flat, xf, n, acts, cols, argmax, stats, dropout, seed)
    L = plan.shape[0]
    k = plan[L - 1, _OC]
    a0 = plan[L - 1, _AOFF]
    logits = acts[a0 : a0 + n * k].reshape((n, k))
    pr = probs[:n]
    loss = K.softmax_cross_entropy_forward(pr, losses[:n], logits, labels[:n], smoothing)
    K.softmax_cross_entropy_backward(
        errs[a0 : a0 + n * k].reshape((n, k)), pr, labels[:n], np.float32(1.0 / n), smoothing
    )
    for j in range(L - 1, -1, -1):
        p = plan[j]
        C, H, W = p[_C], p[_H], p[_W]
        OC, OH, OW = p[_OC], p[_OH], p[_OW]
        in_sz = C * H * W
        out_sz = OC * OH * OW
        a0 = p[_AOFF]
        dout = errs[a0 : a0 + n * out_sz]
        kind = p[_KIND]
        if _drops(dropout, kind, j, L):
            K.dropout_backward(dout, acts[a0 : a0 + n * out_sz], dropout)
        act = p[_ACT]
        if act == _TANH:
            K.tanh_backward(dout, acts[a0 : a0 + n * out_sz])
        elif act == _RELU:
            K.relu_backward(dout, acts[a0 : a0 + n * out_sz])
        need_dx = j > 0
        if need_dx:
            q = plan[j - 1, _AOFF]
            src = acts[q : q + n * in_sz]
            dsrc = errs[q : q + n * in_sz]
        else:
            src = xf[: n * in_sz]
            dsrc = errs[:0]
        if kind == _CONV:
            KH, KW = p[_KH], p[_KW]
            ckk = C * KH * KW
            P = OH * OW
            w0, b0, c0, d0 = p[_WOFF], p[_BOFF], p[_COFF], p[_DCOFF]
            hi = b0 + OC
            dout4 = dout.reshape((n, OC, OH, OW))
            K.conv2d_backward_weights(
                grad[w0:b0].reshape((OC, C, KH, KW)),
                grad[b0:hi],
                dout4,
                cols[c0 : c0 + n * ckk * P].reshape((n, ckk, P)),
            )
            if need_dx:
                K.conv2d_backward_input(
                    dsrc.reshape((n, C, H, W)),
                    dcols[d0 : d0 + ckk * P].reshape((ckk, P)),
                    dout4,
                    flat[w0:b0].reshape((OC, C, KH, KW)),
                )
            # an unused velocity or accumulator is empty (or length 1): its slices are too
            sgd_update_into(flat[w0:hi], acc[w0:hi], grad[w0:hi], velocity[w0:hi], lr, momentum)
        elif kind == _POOL:
            if need_dx:
                m0 = p[_MOFF]
                K.maxpool2_backward(
                    dsrc.reshape((n, C, H, W)),
                    dout.reshape((n, OC, OH, OW)),
                    argmax[m0 : m0 + n * out_sz].reshape((n, OC, OH, OW)),
                )
        elif kind == _BN:  # never the first layer: it follows a conv or fc layer
            w0, b0, s0 = p[_WOFF], p[_BOFF], p[_SOFF]
            hi = b0 + OC
            P = OH * OW
            K.batchnorm_backward(
                dsrc.reshape((n, OC, P)),
                grad[w0:b0],
                grad[b0:hi],
                dout.reshape((n, OC, P)),
                src.reshape((n, OC, P)),
                stats[s0 : s0 + 2 * OC].reshape((2, OC)),
                flat[w0:b0],
            )
            sgd_update_into(flat[w0:hi], acc[w0:hi], grad[w0:hi], velocity[w0:hi], lr, momentum)
        else:
            w0, b0 = p[_WOFF], p[_BOFF]
            if momentum > 0.0:
                vw = velocity[w0:b0].reshape((OC, in_sz))
                vb = velocity[b0 : b0 + OC]
            else:
                vw = velocity[:0].reshape((0, in_sz))
                vb = velocity[:0]
            if acc.shape[0] > 0:
                aw = acc[w0:b0].reshape((OC, in_sz))
                ab = acc[b0 : b0 + OC]
            else:
                aw = acc[:0].reshape((0, in_sz))
                ab = acc[:0]
            dense_backward_update(
                dsrc.reshape((n if need_dx else 0, in_sz)),
                flat[w0:b0].reshape((OC, in_sz)),
                flat[b0 : b0 + OC],
                vw,
                vb,
                aw,
                ab,
                row[:in_sz],
                dout.reshape((n, OC)),
                src.reshape((n, in_sz)),
                lr,
                momentum,
                need_dx,
            )
    return loss


def step(
    net: Trainable,
    ctx: Context,
    x: np.ndarray,
    y: np.ndarray,
    n: int | None,
    lr: float,
    momentum: float,
    velocity: np.ndarray,
    acc: np.ndarray | None = None,
    dense_terms: dict | None = None,
    seed: int = -1,
) -> float:
    """:meth:`Network.step_into`: check what would corrupt memory (the kernels check nothing;
    :func:`~adam_dask.model.checks.check_step`, as the torch engine does), run
    :func:`train_step` (with the network's dropout and label smoothing; ``seed`` >= 0 reseeds
    its draws), and copy the dense layers' offload terms out of the context."""
    n, acc = check_step(net, ctx, x, y, n, momentum, velocity, acc)
    flat = net.flat
    loss = train_step(
        ctx.plan,
        flat,
        ctx.grad,
        velocity,
        acc,
        x,
        y,
        n,
        ctx.act_buf,
        ctx.err_buf,
        ctx.col_buf,
        ctx.dcol_buf,
        ctx.argmax_buf,
        ctx.stats_buf,
        ctx.probs,
        ctx.losses,
        ctx.row,
        lr,
        momentum,
        float(net.dropout),
        int(seed),
        float(net.label_smoothing),
    )
    if dense_terms is not None:
        # the step left each dense layer's input in the previous layer's activations and its
        # error terms (after the activation's derivative) in its own errs region
        for j, L in enumerate(net.layers):
            if L.kind == "fc":
                a = x[:n] if j == 0 else ctx.acts[j - 1][:n]
                dense_terms[str(L.index)] = (a.reshape(n, -1).copy(), ctx.errs[j][:n].copy())
    return float(loss)
