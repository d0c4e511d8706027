"""TLS for the data planes' own sockets on a ``tls://`` cluster, with the certificates of Dask's
own security settings: a node or data server listens with its worker's, a reader or pusher
presents its worker's inside a task, else its client's. Plain clusters get ``None``."""

from __future__ import annotations

from typing import Any

__all__ = ["connect_context", "listen_context"]


def listen_context(worker: Any) -> Any:
    """The SSL context a data plane of ``worker`` listens with (None on a plain cluster)."""
    if not str(worker.address).startswith("tls://"):
        return None
    return worker.security.get_listen_args("worker").get("ssl_context")


def connect_context(client: Any = None) -> Any:
    """The SSL context this process presents to a TLS data plane: the worker's inside a Dask
    task, else ``client``'s (the default client when None); None when it has none."""
    from distributed import get_worker

    try:
        return get_worker().security.get_connection_args("worker").get("ssl_context")
    except ValueError:
        pass
    if client is None:
        from distributed import default_client

        client = default_client()
    return client.security.get_connection_args("client").get("ssl_context")
