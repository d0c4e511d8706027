"""The model: network spec, flat parameter layout, numba kernels; and the PyTorch engine
(``TorchNetwork``, imported on first use so torch stays optional)."""

from __future__ import annotations

from typing import Any

from .layout import ParameterLayout
from .network import Context, Network

__all__ = ["Context", "Network", "ParameterLayout", "TorchNetwork"]


def __getattr__(name: str) -> Any:
    if name == "TorchNetwork":
        from .torch_engine import TorchNetwork

        return TorchNetwork
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
