"""Datasets: ingest into Zarr, open and validate stores, augment images, serve batches.

``DataService`` and ``Augment`` are the names a trainer uses (see ``serving/`` and
``augment.py``); ``load_arrays`` reads a whole split for evaluation and ``to_float`` is the one
conversion of stored pixels to the model's floats.
"""

from __future__ import annotations

from .augment import Augment, as_model_input, to_float
from .datasets import load_arrays
from .serving import DataService

__all__ = ["Augment", "DataService", "as_model_input", "load_arrays", "to_float"]
