"""``adam-dask ingest`` and ``adam-dask info``: dataset stores."""

from __future__ import annotations

import argparse
import logging

from .. import config
from ..cluster import client_for
from ..jobs import json_object, positive_int, size
from ._common import add_cluster, add_storage

logger = logging.getLogger(__name__)

__all__ = ["cmd_info", "cmd_ingest", "register"]


def register(sub) -> None:
    """Add the ``ingest`` and ``info`` sub-commands to ``sub`` (argparse sub-parsers)."""
    p = sub.add_parser("ingest", help="write IDX files or image folders into a Zarr dataset store")
    p.add_argument("src", help="folder (any fsspec URL) of MNIST-style IDX files or class folders")
    p.add_argument("dest", help="URL of the dataset store to write (DEST/train, DEST/test)")
    p.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    p.add_argument(
        "--num-classes",
        type=positive_int,
        default=None,
        help=f"IDX sources: number of classes (default {config.get('data.idx-classes')})",
    )
    p.add_argument(
        "--on-bad-image",
        choices=("fail", "skip"),
        default=None,
        help=f"image folders: unreadable files (default {config.get('data.on-bad-image')})",
    )
    p.add_argument(
        "--image-size",
        type=size,
        default=None,
        metavar="HxW",
        help="image folders: resize every image to HxW (default: the most common size)",
    )
    p.add_argument(
        "--image-mode",
        choices=("L", "RGB"),
        default=None,
        help="image folders: L (grey) or RGB (default: L when every image is grey)",
    )
    p.add_argument(
        "--dest-storage-options",
        type=json_object,
        default=None,
        metavar="JSON",
        help="storage options for DEST when they differ from the source's",
    )
    add_storage(p)
    add_cluster(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("info", help="describe a dataset store")
    p.add_argument("url", help="URL of the dataset store")
    add_storage(p)
    p.set_defaults(func=cmd_info)


def cmd_ingest(args: argparse.Namespace) -> dict:
    from ..data.ingest import ingest

    # without --scheduler/--gateway, ingest runs on its own in-process cluster
    client = client_for(args.scheduler, args.gateway, roles=False, embedded=False)
    try:
        return ingest(
            args.src,
            args.dest,
            client=client,
            overwrite=args.overwrite,
            storage_options=args.storage_options,
            dest_storage_options=args.dest_storage_options,
            num_classes=args.num_classes,
            on_bad_image=args.on_bad_image,
            image_size=args.image_size,
            image_mode=args.image_mode,
            progress=True,
        )
    finally:
        if client is not None:
            client.close()


def cmd_info(args: argparse.Namespace) -> dict:
    from ..data.datasets import describe

    return describe(args.url, args.storage_options)
