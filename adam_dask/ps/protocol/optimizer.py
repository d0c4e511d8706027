"""The parameter server's optimizer: how a shard turns one push's delta into a step.

Adam's server adds the replicas' deltas (``sum``). Its successors put an optimizer there
(DiLoCo's outer Nesterov step on the averaged delta; SNOO's Nesterov step on each delta;
staleness-scaled rates for asynchronous pushes, Zhang et al. 2016). A delta here is what a
replica's weights moved (``local - pulled``, the negative of DiLoCo's pseudo-gradient), so with
a server rate ``lr`` and momentum ``mu``, each push ``d`` (scaled by ``s``, below) does::

    m <- mu * m + s * d                 # the shard's momentum (shard state)
    w <- w + lr * (s * d + mu * m)      # Nesterov's look-ahead

``lr = 1, mu = 0`` is the sum, and ``sum`` takes the sum's own kernel: bit for bit Adam's.

``staleness``: a push applied ``tau`` versions after the version its pusher last read (the
versions the shard moved since: other pushes) is scaled by ``s = 1 / (1 + tau)``; a push whose
pusher named no version read is not scaled. With ``R`` replicas pushing in turn ``tau`` is about
``R - 1``: the replicas' deltas are averaged instead of added, and a push that waited long counts
for less.

Synchronous rounds (DiLoCo, exactly): the pushes of one synchronous step (each replica's ``1/R``
share, marked ``synchronous``) are one outer step on their sum ``D``, whatever order they
arrive in: the first push of the round decays the momentum and the later ones join it::

    first:  m <- mu * m + d;   w <- w + lr * (d + mu * m)
    later:  m <- m + d;        w <- w + lr * (1 + mu) * d

which adds up to ``m <- mu * m + D; w <- w + lr * (D + mu * m)``: DiLoCo's Nesterov step on the
replicas' mean delta. Which push opens a round the shard knows from the marks it recorded, which
travel with its copies and checkpoints, so a backup promoted mid-round continues it; the round's
pushes all read the round's start, so they are not scaled for staleness.

Momentum makes the order of the pushes matter: the copies of a shard agree on the primary's
order, because a backup never applies a push itself: it installs the primary's values and
momentum at a version (:class:`~adam_dask.ps.protocol.shard.ShardCopy`), and a backup promoted
after a fail-over continues from the momentum of the last version it holds. Pure: no I/O, no
clock; the loops are the numba kernels of :mod:`adam_dask.ps.shard_kernels`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...errors import ConfigError
from .shard_kernels import apply_all, nesterov_step

__all__ = ["KINDS", "ServerOptimizer", "staleness_scale"]

KINDS = ("sum", "nesterov")


def staleness_scale(tau: int | None) -> float:
    """The factor of a push applied ``tau`` versions after its pusher read (None: unknown)."""
    if tau is None or tau <= 0:
        return 1.0
    return 1.0 / (1.0 + float(tau))


@dataclass(frozen=True, slots=True)
class ServerOptimizer:
    """What a shard does with each push (see the module doc).

    ``kind``: ``sum`` (Adam's: add the delta) or ``nesterov`` (server momentum over each
    push's delta, rate ``lr``, momentum ``momentum``); ``staleness``: scale each delta by
    :func:`staleness_scale` of how far its shard moved since its pusher read it."""

    kind: str = "sum"
    lr: float = 1.0
    momentum: float = 0.0
    staleness: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(
                f"server optimizer {self.kind!r} is not one of {KINDS}",
                "use 'sum', 'nesterov', 'sum+staleness' or 'nesterov+staleness'",
            )
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"server optimizer lr={self.lr}", "give a rate above 0")
        if not (0.0 <= self.momentum < 1.0):
            raise ConfigError(
                f"server optimizer momentum={self.momentum}", "give a momentum in [0, 1)"
            )

    # -- naming ----------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """``sum``, ``nesterov``, ``sum+staleness`` or ``nesterov+staleness``."""
        return self.kind + ("+staleness" if self.staleness else "")

    @property
    def is_sum(self) -> bool:
        """Adam's own: add each delta as it is (the sum's kernel, no state)."""
        return self.kind == "sum" and not self.staleness

    @property
    def state_vectors(self) -> int:
        """Vectors of the shard's length the optimizer keeps beside the values (momentum)."""
        return 1 if self.kind == "nesterov" else 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> ServerOptimizer:
        if doc is None:
            return cls()
        if isinstance(doc, ServerOptimizer):
            return doc
        return cls(
            str(doc.get("kind", "sum")),
            float(doc.get("lr", 1.0)),
            float(doc.get("momentum", 0.0)),
            bool(doc.get("staleness", False)),
        )

    @classmethod
    def resolve(
        cls,
        spec: Any = None,
        *,
        lr: float | None = None,
        momentum: float | None = None,
    ) -> ServerOptimizer:
        """The optimizer a user names: ``spec`` (a :class:`ServerOptimizer`, a dict of its
        fields, or a name such as ``"nesterov+staleness"``), default ``adam.ps.optimizer``; a
        ``nesterov`` name takes its rate and momentum from ``lr`` / ``momentum`` or
        ``adam.ps.optimizer-lr`` / ``adam.ps.optimizer-momentum``; ``sum`` is 1 and 0."""
        from ... import config

        if isinstance(spec, ServerOptimizer):
            return spec
        if isinstance(spec, dict):
            return cls.from_dict(spec)
        name = str(config.get("ps.optimizer", spec)).strip().lower()
        kind, _, extra = name.partition("+")
        if extra not in ("", "staleness"):
            raise ConfigError(
                f"server optimizer {name!r}: unknown option {extra!r}",
                "use 'sum', 'nesterov', 'sum+staleness' or 'nesterov+staleness'",
            )
        if kind == "sum":
            return cls("sum", 1.0, 0.0, bool(extra))
        return cls(
            kind,
            float(config.get("ps.optimizer-lr", lr)),
            float(config.get("ps.optimizer-momentum", momentum)),
            bool(extra),
        )

    # -- the step --------------------------------------------------------------------------------

    def new_state(self, n: int) -> np.ndarray | None:
        """A fresh shard's optimizer state (zeros), or None when it keeps none."""
        return np.zeros(n, np.float32) if self.state_vectors else None

    def apply(
        self,
        values: np.ndarray,
        state: np.ndarray | None,
        deltas: Sequence[np.ndarray],
        scales: Sequence[float] | None = None,
        joins: Sequence[bool] | None = None,
    ) -> None:
        """Apply ``deltas`` to ``values`` (and ``state``) in order, each scaled by its
        ``scales`` entry with ``staleness`` (1 when omitted; ignored without it); a ``joins``
        entry True: that push joins the synchronous round an earlier push opened (the
        momentum does not decay again; the sum adds it all the same)."""
        if self.is_sum:
            apply_all(values, list(deltas))
            return
        if scales is None or not self.staleness:
            scales = [1.0] * len(deltas)
        if self.kind == "sum":  # staleness alone: a scaled sum
            apply_all(
                values, [d if s == 1.0 else d * np.float32(s) for d, s in zip(deltas, scales)]
            )
            return
        if state is None:
            raise ValueError("a nesterov shard has no momentum")
        if joins is None:
            joins = [False] * len(deltas)
        for d, s, join in zip(deltas, scales, joins):
            nesterov_step(values, state, d, self.lr, self.momentum, s, join)
