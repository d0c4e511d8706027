"""Datasets: ingest into Zarr, open and validate stores, augment images, serve batches.

``DataService`` and ``Augment`` are the names a trainer uses; see ``serving.py`` and
``augment.py``.
"""

from __future__ import annotations

from .augment import Augment, as_model_input
from .serving import BatchStream, DataServer, DataService, load_arrays

__all__ = ["Augment", "BatchStream", "DataServer", "DataService", "as_model_input", "load_arrays"]
