"""The names both engines' modules share without importing each other: the torch engine's tag
and the form of a model factory path (``package.module:callable``)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TORCH", "is_factory_path"]

#: ``to_dict()["engine"]`` of the PyTorch engine (the numba engine's dicts have none)
TORCH = "torch"

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_FACTORY = re.compile(rf"^{_DOTTED}:{_DOTTED}$")


def is_factory_path(text: Any) -> bool:
    """Whether ``text`` names a model factory, ``package.module:callable`` (a spec such as
    ``conv5x5:10`` has a number after its colon, never a name)."""
    return isinstance(text, str) and bool(_FACTORY.match(text.strip()))
