"""The flags several ``adam-dask`` commands share. The parser class and the argument types are
:mod:`adam_dask.jobs`' (the pipelines use them too)."""

from __future__ import annotations

import argparse

from ..jobs import json_object

__all__ = ["add_cluster", "add_storage"]


def add_storage(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-options",
        type=json_object,
        default=None,
        metavar="JSON",
        help="fsspec storage options for every URL, e.g. '{\"endpoint_url\": ...}' "
        "(the AWS_* environment variables work too)",
    )


def add_cluster(p: argparse.ArgumentParser, *, tls: bool = False) -> None:
    """--scheduler / --gateway (and, for commands that start the embedded cluster, --tls)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--scheduler", metavar="ADDRESS", help="use the Dask scheduler at ADDRESS")
    g.add_argument("--gateway", metavar="URL", help="create a cluster on the dask-gateway at URL")
    if tls:
        g.add_argument(
            "--tls",
            action="store_true",
            default=None,
            help="the embedded cluster speaks TLS, with a certificate made for it "
            "(config adam.cluster.tls)",
        )
