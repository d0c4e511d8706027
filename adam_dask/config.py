"""Defaults of adam_dask, kept once in ``adam.yaml`` and read through :mod:`dask.config`.

Every tunable in the package is a keyword argument that defaults to ``None`` and falls back to
``get("section.key")``. Users override in one of three ways, most specific first:

* a keyword argument,
* ``dask.config.set({"adam.ps.shard-bytes": 1 << 19})``,
* an environment variable ``DASK_ADAM__PS__SHARD_BYTES=524288`` or a YAML file in ``~/.config/dask``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dask.config
import yaml

logger = logging.getLogger(__name__)

NAMESPACE = "adam"
_fn = os.path.join(os.path.dirname(__file__), "adam.yaml")

with open(_fn) as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)


def get(key: str, value: Any = None) -> Any:
    """The setting ``adam.<key>``, or ``value`` when it is not ``None`` (a keyword argument wins).

    >>> get("ps.copies")
    3
    >>> get("ps.copies", 2)
    2
    """
    if value is not None:
        return value
    return dask.config.get(f"{NAMESPACE}.{key}")
