"""Ranged pushes and pulls: a pusher that holds only a span ``[start, stop)`` of the flat
parameters (a partition of a model replica, paper 3.2) pushes its span's update to the shards
that overlap it and pulls only those, so a partitioned replica's traffic is split across its
partitions, not duplicated.

A shard that straddles the span's edge gets the span's part, zeros elsewhere (a shard is the
unit of a push: its id, its mark, its replay). The mark of a ranged push names its ``targets``
(the overlapping shards): :func:`~adam_dask.train._position.resume_plan` and
``applied_images`` then ask only those shards whether they hold it. Delivery, ``ack="replay"``,
fail-over replay and exactly-once fencing are the Dask path's (:mod:`._pushing`), unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import ConfigError, UpdateRejected
from .kernels import first_nonfinite
from .state import Mark

logger = logging.getLogger(__name__)

__all__ = ["RangedCalls", "overlapping"]


def overlapping(shards: list[tuple[int, int]], start: int, stop: int) -> list[int]:
    """The shards with a value in ``[start, stop)``."""
    return [s for s, (a, b) in enumerate(shards) if a < stop and b > start]


class RangedCalls:
    """``push_range`` / ``pull_range`` of a :class:`~adam_dask.ps.server.ParameterServer`."""

    size: int
    ack: str
    shards: list[tuple[int, int]]
    _rng: Any

    def _span(self, start: int, n: int) -> tuple[int, int]:
        start, stop = int(start), int(start) + int(n)
        if start < 0 or stop > self.size or n < 1:
            raise ConfigError(
                f"the range [{start}, {stop}) is not inside a server of {self.size} values"
            )
        return start, stop

    def push_range(
        self,
        values: np.ndarray,
        start: int,
        *,
        ack: str | None = None,
        mark: Mark | None = None,
    ) -> None:
        """Add ``values`` (flat float32) to the parameters ``[start, start + len(values))``,
        sending only to the shards that overlap that range. ``mark`` as for ``push`` (its
        ``targets`` become those shards). Raises :class:`UpdateRejected` (nothing applied) on
        NaN/Inf."""
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        start, stop = self._span(start, values.shape[0])
        bad = first_nonfinite(values)
        if bad >= 0:
            raise UpdateRejected(
                f"non-finite update at flat index {start + bad}; nothing was applied",
                "check the gradients for overflow (lower the learning rate)",
            )
        parts: dict[int, np.ndarray | None] = {}
        for s in overlapping(self.shards, start, stop):
            a, b = self.shards[s]
            if a >= start and b <= stop:
                part = values[a - start : b - start]
            else:  # the span's edge: zeros outside it
                part = np.zeros(b - a, np.float32)
                lo, hi = max(a, start), min(b, stop)
                part[lo - a : hi - a] = values[lo - start : hi - start]
            parts[s] = part if part.any() else None
        if mark is not None:
            mark = replace(mark, targets=tuple(sorted(parts)))
        self._run(self._push_parts, parts, ack or self.ack, mark)

    async def _push_parts(
        self, rpc: Any, sched: Any, parts: dict[int, np.ndarray | None], ack: str, mark: Any
    ) -> None:
        push_id = self._rng.getrandbits(62)

        def args(sids: list[int]) -> tuple:
            return ({s: parts[s] for s in sids}, push_id, ack, self._stamps(sids), mark)

        def payload(sid: int) -> tuple[Any, int]:
            p = parts[sid]
            return (None, 0) if p is None else (p.copy(), p.nbytes)

        await self._send_push(rpc, sched, sorted(parts), "push", args, push_id, ack, payload, mark)

    def pull_range(self, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """The current parameters ``[start, stop)`` (from the primaries of the shards that
        overlap it), written into ``out`` (float32 (stop - start,), a new array if omitted)."""
        start, stop = self._span(start, int(stop) - int(start))
        if out is None:
            out = np.zeros(stop - start, np.float32)
        elif out.dtype != np.float32 or out.shape != (stop - start,):
            raise ConfigError(f"out must be a flat float32 array of {stop - start} values")
        self._run(self._pull_parts, overlapping(self.shards, start, stop), start, stop, out)
        return out

    async def _pull_parts(
        self, rpc: Any, sched: Any, sids: list[int], start: int, stop: int, out: np.ndarray
    ) -> None:
        if self._log:
            await self._replay_moved(rpc, sched)

        def args(s: list[int]) -> tuple:
            return (s, self._stamps(s))

        got = await self._each_primary(rpc, sched, sids, "pull", args)
        for sid, values in got.items():
            a, b = self.shards[sid]
            lo, hi = max(a, start), min(b, stop)
            out[lo - start : hi - start] = np.asarray(values)[lo - a : hi - a]

    # provided by the handle's other mixins
    _run: Any
    _log: Any
    _stamps: Any
    _send_push: Any
    _each_primary: Any
    _replay_moved: Any
