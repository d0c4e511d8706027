"""Data serving (Project Adam section 3.1): DataServer actors on the DATA workers.

Each DATA worker runs one :class:`DataServer` actor that owns a *partition* of the dataset (a
contiguous, chunk-aligned range of images), reads it from the Zarr store by chunks (through
fsspec, so ``s3://`` works), keeps it in memory, and augments the next batches of every open
stream ahead of demand in background threads, into a bounded buffer per stream. A trainer
replica reads through a :class:`BatchStream`, which keeps a few ``next_batch`` requests in flight
(peer-to-peer actor calls) and yields ``(x, y)``. A :class:`DataService` starts the servers and
hands out the streams; it pickles, so a replica task opens its stream itself. The batches
themselves travel on the image plane (``adam.serving.data-plane``), not as actor calls.

The parts, each in its own module:

* ``_layout``: who gets which image (partitions, shares, orders; pure);
* ``_cache`` and ``_partition``: a partition server and its chunk cache (threads, no Dask);
* ``_messages``: what a request answers (a batch, the end, an error, a lost server);
* ``_actor``: the DataServer actor around a partition server;
* ``_service``: the DataService (create, server generations, close);
* ``_types``: what the others share about the service without importing it (``ServerRef``, a
  stream's handle on one server; ``Servers``, what a stream asks of its service);
* ``_stream``: the BatchStream (requests in flight, exactly-once delivery, recovery);
* ``_plane`` and ``_plane_source``: the images' data plane (a DataServer's listener and a
  stream's socket: shared slots on one machine, bytes over TCP across machines), which carries
  the batches; the actor calls find its endpoint and probe a slow server.

Failure: a server whose worker dies or freezes is noticed within seconds (a liveness probe),
its partition moves to another live DATA worker, or to the stream itself when none is left, and
back to a DATA worker when one answers again; every image of a share is delivered exactly once.
Closing the service ends open streams with a :class:`~adam_dask.errors.ClusterError`.

Metrics: ``BatchStream.stats()`` (images, waits, stall fraction, recoveries) and
``DataService.stats()`` (per server: images served, buffer occupancy, cache bytes, chunk reads).

Example (no DATA workers: the stream serves itself)::

>>> import tempfile
>>> from adam_dask.testing import synthetic_store
>>> tmp = tempfile.TemporaryDirectory()
>>> url = synthetic_store(tmp.name, n_train=256, n_test=64)
>>> service = DataService.create(None, url, augment=False, batch_size=64)
>>> [x.shape for x, y in service.stream(replica=0, replicas=2, epoch=0)]
[(64, 1, 28, 28), (64, 1, 28, 28)]
>>> service.close()
>>> tmp.cleanup()
"""

from __future__ import annotations

from ._actor import DataServer
from ._service import DataService
from ._stream import BatchStream

__all__ = ["BatchStream", "DataServer", "DataService"]
