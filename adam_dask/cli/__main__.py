"""``python -m adam_dask.cli``: the ``adam-dask`` command."""

from __future__ import annotations

from . import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
