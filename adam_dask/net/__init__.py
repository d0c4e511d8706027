"""The sockets under the house's own planes, shared by the parameter server's data plane
(:mod:`adam_dask.ps.plane`), the images' plane (:mod:`adam_dask.data.serving`) and the links of
a partitioned replica (:mod:`adam_dask.train`):

* :mod:`.framing`: one message is a length, a msgpack header and the raw bytes it announces;
* :mod:`.listen`: a plane's listeners next to a worker (a Unix socket and TCP), a thread per
  connection, the peer's token checked first;
* :mod:`.tls`: the SSL contexts of Dask's own security settings on a ``tls://`` cluster.

Nothing here knows what a plane carries: the planes import this package, never the reverse.
"""
