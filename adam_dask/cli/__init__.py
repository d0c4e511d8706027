"""The ``adam-dask`` command: ingest, info (``data.py``), train, evaluate (``train.py``), show
(``show.py``: a finished run's summary and curves).

Each command prints progress on stderr and, as its last line on stdout, one JSON object of its
results. Bad input exits with status 2 and one line ``error: <what was wrong>; <what to do>``,
no traceback; the other statuses are :mod:`adam_dask.jobs`'. Credentials given in
``--storage-options``, the AWS variables or URLs never appear in the output.

This package imports the library; nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from .. import __version__
from ..jobs import ArgumentParser, Redactor, run_job, setup_logging
from . import data, show, train

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    """The ``adam-dask`` argument parser, every sub-command included."""
    parser = ArgumentParser(
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
        help="more logging on stderr (-vv for Dask's own in this process)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    data.register(sub)
    train.register(sub)
    show.register(sub)
    return parser


def run(argv: Sequence[str] | None = None, out: Callable[[str], None] | None = None) -> int:
    """Run the CLI; returns the exit status. The JSON result goes to ``out`` (stdout).

    Bad flags exit at once (``SystemExit`` with status 2), as argparse does.
    """
    args = build_parser().parse_args(argv)
    redactor = Redactor(
        [getattr(args, "storage_options", None), getattr(args, "dest_storage_options", None)]
    )
    setup_logging(args.verbose, redactor)
    return run_job(lambda: args.func(args), redactor, verbose=args.verbose, out=out)


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: run the CLI and exit with its status."""
    sys.exit(run(argv))
