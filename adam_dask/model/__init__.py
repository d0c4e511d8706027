"""The model: network spec, flat parameter layout, numba kernels."""

from __future__ import annotations

from .layout import ParameterLayout
from .network import Context, Network

__all__ = ["Context", "Network", "ParameterLayout"]
