"""Where the copies of shards go: the placement policy, as plain functions (no Dask).

* :func:`plan_placement`: the copies of every shard of a new server on distinct hosts
  (distinct workers when there are too few hosts, with a :class:`PlacementWarning`),
  primaries balanced over the PS workers first, then all copies.
* :func:`choose_new_holder`: where a shard's next copy goes (a host the shard does not use).
* :func:`choose_primary`: which surviving copy becomes the primary (the newest).

The controller's state machine (:mod:`adam_dask.ps.protocol.controller`) decides with these; the
scheduler plugin (:mod:`adam_dask.ps.runtime.plugin`) carries its decisions out. The public names
are re-exported by :mod:`adam_dask.ps.placement`, the module a scheduler preloads.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from typing import Any

from ...errors import ClusterError

logger = logging.getLogger(__name__)

__all__ = [
    "PLUGIN_NAME",
    "ROLE",
    "TOPIC",
    "PlacementWarning",
    "choose_new_holder",
    "choose_primary",
    "plan_placement",
]

PLUGIN_NAME = "adam-ps-placement"
TOPIC = "adam-ps"
ROLE = "PS"


class PlacementWarning(UserWarning):
    """Copies of a shard had to share a host (or there are fewer workers than copies)."""


def plan_placement(
    n_shards: int,
    workers: dict[str, str],
    copies: int,
    load: Counter | None = None,
    primary_load: Counter | None = None,
) -> dict[int, list[str]]:
    """{shard: [primary, backups...]} for ``n_shards`` shards over ``workers`` ({addr: host}).

    Every shard's copies go to distinct hosts while there are enough, else to distinct workers
    (a :class:`PlacementWarning`); primaries are balanced first, then total copies.
    """
    if not workers:
        raise ClusterError(
            "no parameter-server workers to place shards on",
            "start workers with the resource PS=1 (adam_dask.cluster.local does)",
        )
    load = Counter(load or {})
    primary_load = Counter(primary_load or {})
    hosts = set(workers.values())
    k = min(copies, len(workers))
    if k < copies:
        warnings.warn(
            f"{len(workers)} PS workers cannot hold {copies} copies; keeping {k}",
            PlacementWarning,
            stacklevel=2,
        )
    if len(hosts) < k:
        warnings.warn(
            f"only {len(hosts)} distinct PS hosts for {k} copies: some copies of a "
            "shard share a host",
            PlacementWarning,
            stacklevel=2,
        )
    addrs = sorted(workers)
    plan: dict[int, list[str]] = {}
    for sid in range(n_shards):
        primary = min(
            addrs, key=lambda a: (primary_load[a], load[a], (addrs.index(a) - sid) % len(addrs))
        )
        chosen = [primary]
        primary_load[primary] += 1
        load[primary] += 1
        while len(chosen) < k:
            nxt = choose_new_holder(chosen, workers, load)
            if nxt is None:  # pragma: no cover - k <= len(workers)
                break
            chosen.append(nxt)
            load[nxt] += 1
        plan[sid] = chosen
    return plan


def choose_new_holder(
    holders: list[str],
    workers: dict[str, str],
    load: Counter,
    ready: set[str] | frozenset[str] = frozenset(),
) -> str | None:
    """The worker for a shard's next copy: on a host none of ``holders`` uses if there is one,
    else any worker not among ``holders``; among those, one in ``ready`` (it holds a node of the
    server already: no actor to start, which takes seconds on a fresh worker), then the least
    loaded. None when every worker holds a copy."""
    used_hosts = {workers.get(a) for a in holders}
    free = [a for a in sorted(workers) if a not in holders]
    best = [a for a in free if workers[a] not in used_hosts] or free
    if not best:
        return None
    return min(best, key=lambda a: (a not in ready, load[a], a))


def _descending(position: Any) -> Any:
    return tuple(-x for x in position) if isinstance(position, tuple) else -position


def choose_primary(positions: dict[str, Any], primary_load: Counter) -> str:
    """The copy to promote: the newest (a version, or a ``(generation, version)`` position),
    then the worker with fewest primaries."""
    return min(positions, key=lambda a: (_descending(positions[a]), primary_load[a], a))
