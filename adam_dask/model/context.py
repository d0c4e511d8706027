"""A thread's pre-allocated work buffers for a network, and the network's plan as an int64 table.

Every buffer is one flat array (activations, error terms, im2col patches, pooling winners, ...)
with per-layer views into it, so two paths share a :class:`Context`:

* the layer-by-layer passes in :mod:`adam_dask.model.passes` (one kernel call per layer and
  pass) read the named views (``ctx.acts[i]``, ``ctx.cols[i]``, ...);
* the fused step in :mod:`adam_dask.model.fused` (one numba call per mini-batch) reads the flat
  buffers through the offsets in ``ctx.plan``.

The first ``n`` images of a layer's region are its first ``n * size`` values, so a batch smaller
than the context's works in both paths.
"""

from __future__ import annotations

import logging

import numpy as np

from .protocol import NetworkPlan

logger = logging.getLogger(__name__)

__all__ = ["ACT_CODES", "KINDS", "PLAN_COLUMNS", "Context"]

#: The columns of ``Context.plan``, one row per layer. Shapes are per image: a dense layer is
#: (C, H, W) = (inputs, 1, 1) -> (OC, OH, OW) = (outputs, 1, 1); pooling keeps OC = C. Offsets
#: index ``net.flat`` (weights, bias) and the context's flat buffers (acts/errs, cols, dcols,
#: argmax, stats); ``row`` is the dense layers' one-row scratch (its size is the widest input).
#: A bn layer is (C, H, W) -> (C, H, W) (after a dense layer, (O, 1, 1)); its weight and bias
#: are the scale and shift, and its stats region holds the batch's (mean, invstd) per channel.
PLAN_COLUMNS = (
    "kind",
    "act",
    "c",
    "h",
    "w",
    "oc",
    "oh",
    "ow",
    "kh",
    "kw",
    "w_off",
    "b_off",
    "act_off",
    "cols_off",
    "dcols_off",
    "argmax_off",
    "stats_off",
)
KINDS = {"conv": 0, "maxpool": 1, "fc": 2, "bn": 3}
ACT_CODES = {None: 0, "tanh": 1, "relu": 2}


class Context:
    """Pre-allocated work buffers for batches of up to ``batch_size`` images: activations, error
    terms, im2col patches, pooling winners, a dense-row scratch, and a flat gradient buffer with
    named views. One per thread; never shared.

    Attributes: ``acts`` / ``errs`` (per layer, (B, *out_shape) views), ``cols`` / ``dcols`` /
    ``argmax`` / ``stats`` (dicts by layer index; ``stats[i]`` (2, C) is the last training
    batch's mean and 1/std per channel of bn layer ``i``), ``grad`` (flat, like ``net.flat``;
    all zero between steps) and ``gviews``, ``probs`` (B, classes), ``losses`` (B,), and the
    flat buffers ``act_buf``, ``err_buf``, ``col_buf``, ``dcol_buf``, ``argmax_buf``,
    ``stats_buf``, ``row`` with ``plan`` (int64, one row per layer, columns
    :data:`PLAN_COLUMNS`) for the fused step.
    """

    def __init__(self, net: NetworkPlan, batch_size: int):
        B = self.batch_size = int(batch_size)
        self.network_id = id(net)  # a step checks that its context is its network's
        self.spec = net.spec
        self.input_shape = net.input_shape
        layers = net.layers
        plan = np.zeros((len(layers), len(PLAN_COLUMNS)), np.int64)
        col = {name: k for k, name in enumerate(PLAN_COLUMNS)}
        act_size = cols_size = dcols_size = argmax_size = stats_size = row_size = 0
        for j, L in enumerate(layers):
            r = plan[j]
            r[col["kind"]] = KINDS[L.kind]
            r[col["act"]] = ACT_CODES[L.act]
            ins = L.in_shape if len(L.in_shape) == 3 else (L.in_shape[0], 1, 1)
            outs = L.out_shape if len(L.out_shape) == 3 else (L.out_shape[0], 1, 1)
            if L.kind == "fc":
                ins = (L.in_size, 1, 1)
                row_size = max(row_size, L.in_size)
            r[col["c"] : col["w"] + 1] = ins
            r[col["oc"] : col["ow"] + 1] = outs
            r[col["kh"]], r[col["kw"]] = L.kernel
            if L.has_params:
                we, be = net.layout[f"{L.index}.weight"], net.layout[f"{L.index}.bias"]
                assert be.offset == we.offset + we.size, "a bias follows its weight"
                r[col["w_off"]], r[col["b_off"]] = we.offset, be.offset
            r[col["act_off"]] = act_size
            act_size += B * int(np.prod(outs))
            if L.kind == "conv":
                ckk_p = ins[0] * L.kernel[0] * L.kernel[1] * outs[1] * outs[2]
                r[col["cols_off"]], r[col["dcols_off"]] = cols_size, dcols_size
                cols_size += B * ckk_p
                dcols_size += ckk_p
            elif L.kind == "maxpool":
                r[col["argmax_off"]] = argmax_size
                argmax_size += B * int(np.prod(outs))
            elif L.kind == "bn":
                r[col["stats_off"]] = stats_size
                stats_size += 2 * outs[0]
        self.plan = plan
        self.act_buf = np.zeros(act_size, np.float32)
        self.err_buf = np.zeros(act_size, np.float32)
        self.col_buf = np.zeros(cols_size, np.float32)
        self.dcol_buf = np.zeros(dcols_size, np.float32)
        self.argmax_buf = np.zeros(argmax_size, np.int8)
        self.stats_buf = np.zeros(max(stats_size, 1), np.float32)
        self.row = np.zeros(max(row_size, 1), np.float32)

        def view(buf, off, shape):
            return buf[off : off + int(np.prod(shape))].reshape(shape)

        self.acts: list[np.ndarray] = []
        self.errs: list[np.ndarray] = []
        self.cols: dict[int, np.ndarray] = {}
        self.dcols: dict[int, np.ndarray] = {}
        self.argmax: dict[int, np.ndarray] = {}
        self.stats: dict[int, np.ndarray] = {}
        for j, L in enumerate(layers):
            r = plan[j]
            a0 = int(r[col["act_off"]])
            self.acts.append(view(self.act_buf, a0, (B, *L.out_shape)))
            self.errs.append(view(self.err_buf, a0, (B, *L.out_shape)))
            if L.kind == "conv":
                ckk = L.in_shape[0] * L.kernel[0] * L.kernel[1]
                p = L.out_shape[1] * L.out_shape[2]
                self.cols[L.index] = view(self.col_buf, int(r[col["cols_off"]]), (B, ckk, p))
                self.dcols[L.index] = view(self.dcol_buf, int(r[col["dcols_off"]]), (ckk, p))
            elif L.kind == "maxpool":
                self.argmax[L.index] = view(
                    self.argmax_buf, int(r[col["argmax_off"]]), (B, *L.out_shape)
                )
            elif L.kind == "bn":
                self.stats[L.index] = view(
                    self.stats_buf, int(r[col["stats_off"]]), (2, L.out_shape[0])
                )
        k = net.classes
        self.probs = np.zeros((B, k), np.float32)
        self.losses = np.zeros(B, np.float32)
        self.labels = np.zeros(B, np.int64)
        self.grad = net.layout.allocate()
        self.gviews = net.layout.views(self.grad)
        self.dummy = np.zeros((1, 1), np.float32)

    def __repr__(self) -> str:
        return f"Context({self.spec!r}, batch_size={self.batch_size})"
