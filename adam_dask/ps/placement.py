"""Shard placement: the policy (:mod:`adam_dask.ps.protocol.policy`, plain functions) and the scheduler
preload that installs the controller plugin: ``dask scheduler --preload adam_dask.ps.placement``
(the gateway values and operator manifests in ``deploy/`` do this), so a scheduler has the
controller before any client connects. ``ParameterServer.create`` registers it otherwise.
"""

from __future__ import annotations

from typing import Any

from .protocol.policy import (
    PLUGIN_NAME,
    ROLE,
    TOPIC,
    PlacementWarning,
    choose_new_holder,
    choose_primary,
    plan_placement,
)
from .runtime.plugin import ShardPlacement

__all__ = [
    "PLUGIN_NAME",
    "ROLE",
    "TOPIC",
    "PlacementWarning",
    "ShardPlacement",
    "choose_new_holder",
    "choose_primary",
    "dask_setup",
    "plan_placement",
]


def dask_setup(scheduler: Any) -> None:
    """Scheduler preload hook: installs the controller plugin."""
    scheduler.add_plugin(ShardPlacement())
