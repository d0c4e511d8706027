"""The dense-layer offload's update (paper 3.2.6) cut to a shard: for a dense layer of ``out``
outputs and ``inp`` inputs over a batch of ``B`` samples, ``errors (B, out)`` and
``activations (B, inp)`` make ``scale * errors.T @ activations`` (``(out, inp)``, row-major),
added to the flat buffer at ``offset``; each shard computes the rows that touch its slice.
Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["OuterPart", "outer_delta", "outer_part"]


@dataclass(frozen=True, slots=True)
class OuterPart:
    """The part of an outer-product update that falls into one shard.

    The dense matrix ``(out, inp)`` lives at ``flat[offset : offset + out * inp]``; this shard
    needs rows ``row0 : row1`` of it, of which it keeps ``flat[lo : hi]`` (global indices).
    """

    row0: int
    row1: int
    lo: int
    hi: int


def outer_part(offset: int, out: int, inp: int, start: int, stop: int) -> OuterPart | None:
    """Which rows of an ``(out, inp)`` matrix at ``offset`` touch the shard ``[start, stop)``."""
    lo, hi = max(start, offset), min(stop, offset + out * inp)
    if lo >= hi:
        return None
    row0 = (lo - offset) // inp
    row1 = (hi - offset + inp - 1) // inp
    return OuterPart(row0, row1, lo, hi)


def outer_delta(
    part: OuterPart,
    offset: int,
    inp: int,
    errors: np.ndarray,
    activations: np.ndarray,
    scale: float,
) -> np.ndarray:
    """``scale * errors[:, rows].T @ activations``, cut to the shard's slice ``[lo, hi)``.

    ``errors`` holds the columns ``row0:row1`` only when its width equals ``row1 - row0``
    (what the client sends); a full ``(B, out)`` array is cut here.
    """
    if errors.shape[1] != part.row1 - part.row0:
        errors = errors[:, part.row0 : part.row1]
    m = (errors.T @ activations).astype(np.float32, copy=False).reshape(-1)
    if scale != 1.0:
        m *= np.float32(scale)
    base = offset + part.row0 * inp
    return m[part.lo - base : part.hi - base]
