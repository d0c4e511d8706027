"""What a caller hands the parameter server, checked once and shaped into a
:class:`~adam_dask.ps.protocol.request.Request`: a whole delta (scanned for NaN/Inf and for the
shards it touches, copied once into a pool buffer unless it is one), a range of a partition,
the dense offload's activations and errors, a buffer to pull into. Pure apart from the copy
into the pool: bad input raises :class:`UpdateRejected` or :class:`ConfigError` in one line and
nothing is sent."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ...errors import ConfigError, UpdateRejected
from ..protocol.outer import outer_part
from ..protocol.request import Outer, Request, overlapping
from ..protocol.shard import Mark
from ..protocol.shard_kernels import first_nonfinite, scan_delta
from .build import shard_of

__all__ = [
    "checked_delta",
    "out_buffer",
    "outer_request",
    "range_request",
    "shard_ids",
    "span",
]


def checked_delta(
    delta: Any, size: int, shards: list[tuple[int, int]], bounds: np.ndarray, pool: Any
) -> tuple[np.ndarray, np.ndarray, Any]:
    """``delta`` as a flat float32 array of the server's size, which shards hold a non-zero
    value, and the pool segment it was copied into (None: used where it is, a pool buffer
    already or no pool); :class:`UpdateRejected` when its length is wrong or it holds NaN/Inf:
    the one check of the values."""
    if not (isinstance(delta, np.ndarray) and delta.dtype == np.float32 and delta.ndim == 1):
        delta = np.ascontiguousarray(delta, dtype=np.float32).reshape(-1)
    delta = np.ascontiguousarray(delta)
    if delta.shape[0] != size:
        raise UpdateRejected(
            f"a delta of {delta.shape[0]} values for a server of {size}",
            "push one value per parameter",
        )
    bad, nonzero = scan_delta(delta, bounds)
    if bad >= 0:
        sid = shard_of(shards, bad)
        raise UpdateRejected(
            f"non-finite update at flat index {bad} (shard {sid}); nothing was applied",
            "check the gradients for overflow",
            shard=sid,
        )
    seg = None
    if pool is not None and pool.of(delta) is None:
        seg = pool.take()  # a copy, not fused into the scan: numba's fused
        np.copyto(seg.array, delta)  # loop measured slower than the two passes
    return (delta if seg is None else seg.array), nonzero, seg


def out_buffer(out: np.ndarray | None, size: int) -> np.ndarray:
    """Where a pull of the whole server writes: ``out`` checked, or zeros."""
    if out is None:
        return np.zeros(size, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (size,):
        raise ConfigError(f"out must be a flat float32 array of {size} values")
    return out


def span(start: int, n: int, size: int) -> tuple[int, int]:
    """``[start, start + n)`` checked to lie inside a server of ``size`` values."""
    start, stop = int(start), int(start) + int(n)
    if start < 0 or stop > size or n < 1:
        raise ConfigError(f"the range [{start}, {stop}) is not inside a server of {size} values")
    return start, stop


def outer_request(
    offset: int,
    errors: np.ndarray,
    activations: np.ndarray,
    scale: float,
    size: int,
    shards: list[tuple[int, int]],
    push_id: int,
    ack: str,
    mark: Mark | None,
) -> Request:
    """The dense offload's push: ``scale * errors.T @ activations`` added at ``offset``, sent
    to the shards the (out, in) block touches with the error columns each needs."""
    errors = np.ascontiguousarray(errors, dtype=np.float32)
    activations = np.ascontiguousarray(activations, dtype=np.float32)
    if errors.ndim != 2 or activations.ndim != 2 or errors.shape[0] != activations.shape[0]:
        raise UpdateRejected(
            f"push_outer needs errors (B, out) and activations (B, in), got "
            f"{errors.shape} and {activations.shape}"
        )
    out, inp = errors.shape[1], activations.shape[1]
    if offset < 0 or offset + out * inp > size:
        raise UpdateRejected(
            f"an ({out}, {inp}) update at offset {offset} does not fit in {size} parameters"
        )
    for name, m in (("errors", errors), ("activations", activations)):
        if first_nonfinite(m) >= 0:
            raise UpdateRejected(f"non-finite {name} in push_outer; nothing was applied")
    cols: dict[int, tuple[int, int]] = {}
    for s, (a, b) in enumerate(shards):
        p = outer_part(offset, out, inp, a, b)
        if p is not None:
            cols[s] = (p.row0, p.row1)
    if mark is not None:  # the shards this part goes to: a re-run checks each has it
        mark = replace(mark, targets=tuple(sorted(cols)))
    outer = Outer(int(offset), out, inp, float(scale), errors, activations, cols)
    return Request("push", tuple(sorted(cols)), push_id, ack, mark, outer=outer)


def range_request(
    values: np.ndarray,
    start: int,
    size: int,
    shards: list[tuple[int, int]],
    push_id: int,
    ack: str,
    mark: Mark | None,
) -> Request:
    """A partition's push: ``values`` added to ``[start, start + len(values))``, sent to the
    shards that overlap it (zeros outside it for a shard straddling its edge)."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    start, stop = span(start, values.shape[0], size)
    bad = first_nonfinite(values)
    if bad >= 0:
        raise UpdateRejected(
            f"non-finite update at flat index {start + bad}; nothing was applied",
            "check the gradients for overflow (lower the learning rate)",
        )
    sids = tuple(overlapping(shards, start, stop))
    nonzero = {}
    for s in sids:
        a, b = shards[s]
        nonzero[s] = bool(values[max(a, start) - start : min(b, stop) - start].any())
    if mark is not None:
        mark = replace(mark, targets=sids)
    return Request("push", sids, push_id, ack, mark, values=values, base=start, nonzero=nonzero)


def shard_ids(shards: Any, n: int) -> tuple[int, ...]:
    """The shards a pull asks for: every one of ``n`` (None), else those named, each checked."""
    sids = range(n) if shards is None else sorted({int(s) for s in shards})
    for s in sids:
        if not 0 <= s < n:
            raise ConfigError(f"no shard {s}: the server has {n}")
    return tuple(sids)
