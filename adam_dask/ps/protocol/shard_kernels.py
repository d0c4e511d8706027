"""The numba kernels of a parameter-server shard: adding deltas to its values, and finding a
non-finite value before anything is applied; the server optimizer's Nesterov step.

A batch of deltas is applied fused, up to 8 at a time, each block of values (a SIMD vector, held
in registers) taking every delta of the group before the next block, so the shard's values make
one trip through memory per 8 updates instead of one per update; the per-element order of the
additions is the push order. The slow references are numpy's ``values += delta`` and
``np.isfinite``; tests/ps/test_state.py checks the kernels against them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "apply_all",
    "apply_rate_kernel",
    "first_nonfinite",
    "nesterov_step",
    "scan_delta",
    "warm_up",
]


# -- kernels -------------------------------------------------------------------------------------


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz", "arcp", "contract"})
def _nonfinite_probe(x):
    """``sum(x * 0)``: NaN exactly when ``x`` holds a NaN or an Inf. It vectorises: the fast-math
    flags allow reordering the sum but keep NaN/Inf semantics (no ``nnan``/``ninf``)."""
    acc = np.float32(0.0)
    zero = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * zero
    return acc


@njit(nogil=True, cache=True)
def _first_nonfinite(x):
    """Index of the first NaN/Inf in ``x`` (1-D float32), or -1 (a fast probe, then a scan
    only when the probe finds something)."""
    p = _nonfinite_probe(x)
    if p == p:
        return -1
    for i in range(x.shape[0]):
        v = x[i]
        if v != v or v == np.inf or v == -np.inf:
            return i
    return -1


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz", "arcp", "contract"})
def _probe_and_magnitude(x, lo, hi):
    """(``sum(x * 0)``, ``sum(|x|)``) over ``x[lo:hi]``: NaN in the first exactly when the slice
    holds a NaN or an Inf; the second is 0 exactly when the slice is all zeros."""
    acc = np.float32(0.0)
    mag = np.float32(0.0)
    zero = np.float32(0.0)
    for i in range(lo, hi):
        v = x[i]
        acc += v * zero
        mag += abs(v)
    return acc, mag


@njit(nogil=True, cache=True)
def _scan(x, bounds, nonzero):
    """One pass over ``x``: for each shard ``bounds[s] = (start, stop)`` set ``nonzero[s]``;
    returns the first index holding NaN/Inf, or -1."""
    for s in range(bounds.shape[0]):
        lo, hi = bounds[s, 0], bounds[s, 1]
        acc, mag = _probe_and_magnitude(x, lo, hi)
        if acc != acc:
            for i in range(lo, hi):
                v = x[i]
                if v != v or v == np.inf or v == -np.inf:
                    return i
        nonzero[s] = mag > 0
    return -1


@njit(nogil=True, cache=True)
def _add(values, delta):
    """values += delta (both 1-D float32, same length)."""
    for i in range(values.shape[0]):
        values[i] += delta[i]


@njit(nogil=True, cache=True)
def _add2(values, d0, d1):
    """values += d0 + d1 in one pass (the additions in push order, as if applied one by one)."""
    for i in range(values.shape[0]):
        v = values[i]
        v += d0[i]
        v += d1[i]
        values[i] = v


@njit(nogil=True, cache=True)
def _add4(values, d0, d1, d2, d3):
    for i in range(values.shape[0]):
        v = values[i]
        v += d0[i]
        v += d1[i]
        v += d2[i]
        v += d3[i]
        values[i] = v


@njit(nogil=True, cache=True)
def _add8(values, d0, d1, d2, d3, d4, d5, d6, d7):
    for i in range(values.shape[0]):
        v = values[i]
        v += d0[i]
        v += d1[i]
        v += d2[i]
        v += d3[i]
        v += d4[i]
        v += d5[i]
        v += d6[i]
        v += d7[i]
        values[i] = v


@njit(nogil=True, cache=True)
def _add_at(values, lo, delta):
    """values[lo:lo + len(delta)] += delta."""
    for i in range(delta.shape[0]):
        values[lo + i] += delta[i]


@njit(nogil=True, cache=True)
def _nesterov(values, m, d, lr, mu, s):
    """One push through server momentum, element by element in float32 (see
    :mod:`adam_dask.ps.protocol.optimizer`): ``g = s d``, ``m = mu m + g``,
    ``values += lr (g + mu m)``."""
    for i in range(values.shape[0]):
        g = s * d[i]
        mi = mu * m[i] + g
        m[i] = mi
        values[i] += lr * (g + mu * mi)


@njit(nogil=True, cache=True)
def _nesterov_join(values, m, d, lr, mu, s):
    """A later push of a synchronous round (see :mod:`adam_dask.ps.protocol.optimizer`):
    ``g = s d``, ``m = m + g``, ``values += lr (g + mu g)``."""
    for i in range(values.shape[0]):
        g = s * d[i]
        m[i] += g
        values[i] += lr * (g + mu * g)


def nesterov_step(
    values: np.ndarray,
    momentum: np.ndarray,
    delta: np.ndarray,
    lr: float,
    mu: float,
    scale: float,
    join: bool = False,
) -> None:
    """Apply one push's ``delta`` to ``values`` through the shard's ``momentum`` (in place);
    ``join``: the push joins a synchronous round another push opened (no second decay)."""
    f = np.float32
    (_nesterov_join if join else _nesterov)(values, momentum, delta, f(lr), f(mu), f(scale))


def apply_all(values: np.ndarray, deltas: list[np.ndarray]) -> None:
    """values += sum(deltas), in push order: groups of 8 (then 4, 2, 1) deltas are fused into
    one pass over the values, so a batch costs one trip through memory per 8 updates instead of
    one per update (each vector-sized block of values takes all 8 deltas before the next)."""
    i, n = 0, len(deltas)
    while n - i >= 8:
        _add8(values, *deltas[i : i + 8])
        i += 8
    if n - i >= 4:
        _add4(values, *deltas[i : i + 4])
        i += 4
    if n - i >= 2:
        _add2(values, *deltas[i : i + 2])
        i += 2
    if i < n:
        _add(values, deltas[i])


def first_nonfinite(x: np.ndarray) -> int:
    """Index of the first non-finite value of a float32 array (any shape), or -1."""
    return int(_first_nonfinite(np.ascontiguousarray(x, dtype=np.float32).reshape(-1)))


def scan_delta(x: np.ndarray, bounds: np.ndarray) -> tuple[int, np.ndarray]:
    """The pusher's one check of a flat float32 delta: (the first index holding NaN/Inf or -1,
    which shards of ``bounds`` (S, 2) hold a non-zero value), in one pass over the values."""
    nonzero = np.zeros(bounds.shape[0], np.bool_)
    return int(_scan(x, bounds, nonzero)), nonzero


def apply_rate_kernel(values: np.ndarray, delta: np.ndarray) -> None:
    """``values += delta`` with the shard's kernel (exposed for the benchmark)."""
    _add(values, delta)


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel, so the first push does not stall
    the caller: a PS node calls this in a thread before it serves, because compiling on its
    event loop would silence its heartbeats for seconds."""
    x = np.zeros(8, np.float32)
    _first_nonfinite(x)
    scan_delta(x, np.array([[0, 8]], np.int64))
    apply_all(x, [x.copy() for _ in range(15)])
    _add_at(x, 0, x[:2].copy())
    nesterov_step(x, x.copy(), x.copy(), 1.0, 0.0, 1.0)
