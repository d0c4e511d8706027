"""The ``adam-dask`` command: ingest, info, train, evaluate.

Each command prints progress on stderr and, as its last line on stdout, one JSON object of its
results. Bad input exits with status 2 and one line ``error: <what was wrong>; <what to do>``,
no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

from . import __version__, config
from .errors import AdamError

logger = logging.getLogger(__name__)

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc.msg} at column {exc.colno})"
        ) from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"anon\": true}'")
    return value


def _size_arg(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError("use HxW, e.g. 28x28") from exc
    return h, w


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags as one ``error:`` line and exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"error: {message}; see `{self.prog} --help`\n")


def _add_storage(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-options",
        type=_json_arg,
        default=None,
        metavar="JSON",
        help="fsspec storage options for every URL, e.g. '{\"endpoint_url\": ...}' "
        "(the AWS_* environment variables work too)",
    )


def _add_cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--scheduler", metavar="ADDRESS", help="use the Dask scheduler at ADDRESS")
    g.add_argument("--gateway", metavar="URL", help="create a cluster on the dask-gateway at URL")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="adam-dask",
        description="Project Adam on Dask: asynchronous "
        "data-parallel training with a replicated parameter server.",
    )
    parser.add_argument("--version", action="version", version=f"adam-dask {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more logging on stderr (-vv for Dask's own)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("ingest", help="write IDX files or image folders into a Zarr dataset store")
    p.add_argument("src", help="folder (any fsspec URL) of MNIST-style IDX files or class folders")
    p.add_argument("dest", help="URL of the dataset store to write (DEST/train, DEST/test)")
    p.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    p.add_argument(
        "--num-classes",
        type=int,
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
        type=_size_arg,
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
        type=_json_arg,
        default=None,
        metavar="JSON",
        help="storage options for DEST when they differ from the source's",
    )
    _add_storage(p)
    _add_cluster(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("info", help="describe a dataset store")
    p.add_argument("url", help="URL of the dataset store")
    _add_storage(p)
    p.set_defaults(func=cmd_info)

    _add_train_commands(sub)
    return parser


def _add_train_commands(sub) -> None:
    """``train`` and ``evaluate`` live beside the Trainer (train/commands.py)."""
    from .train import commands

    commands.register(sub, _add_storage, _add_cluster)


def client_for(args, workers: int | None = None):
    """A client for --scheduler/--gateway (a gateway cluster of ``workers`` workers), or None:
    the command then uses its embedded default."""
    from .cluster import connect

    if getattr(args, "scheduler", None):
        return connect(args.scheduler)
    if getattr(args, "gateway", None):
        return connect(gateway=args.gateway, workers=workers)
    return None


def cmd_ingest(args) -> dict:
    from .data.ingest import ingest

    client = client_for(args)
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


def cmd_info(args) -> dict:
    from .data.datasets import describe

    return describe(args.url, args.storage_options)


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # Dask logs every worker start and comm closure at INFO and shutdown noise at ERROR
    dask_level = logging.INFO if verbose >= 2 else logging.CRITICAL
    for name in ("distributed", "tornado", "asyncio", "bokeh"):
        logging.getLogger(name).setLevel(dask_level)
    os.environ.setdefault(
        "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED", "critical" if verbose < 2 else "info"
    )


def run(argv: Sequence[str] | None = None, out: Callable[[str], None] | None = None) -> int:
    """Run the CLI; returns the exit status. The JSON result goes to ``out`` (stdout)."""
    out = out or (lambda s: print(s, flush=True))
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        result = args.func(args)
    except AdamError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted; the last complete checkpoint (if any) is kept\n")
        return EXIT_INTERRUPTED
    except Exception as exc:  # anything unforeseen still gets one line, not a traceback
        if args.verbose:
            logger.exception("unexpected failure")
        first = str(exc).splitlines()[0] if str(exc) else ""
        sys.stderr.write(f"error: {type(exc).__name__}: {first}; run again with -v for details\n")
        return EXIT_ERROR
    out(json.dumps(result, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":  # pragma: no cover
    main()
