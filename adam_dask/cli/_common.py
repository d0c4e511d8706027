"""What every ``adam-dask`` command shares: the parser class, argument types, common flags."""

from __future__ import annotations

import argparse
import json
import math
from typing import NoReturn

from ..jobs import EXIT_ERROR

__all__ = [
    "Parser",
    "add_cluster",
    "add_storage",
    "count",
    "fraction",
    "json_object",
    "positive_float",
    "positive_int",
    "size",
]


class Parser(argparse.ArgumentParser):
    """argparse that reports bad flags as one ``error:`` line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"error: {message}; see `{self.prog} --help`\n")


def json_object(text: str) -> dict:
    """``--storage-options``: a JSON object. The message never repeats the text (it may hold
    credentials)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc.msg} at column {exc.colno})"
        ) from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"anon\": true}'")
    return value


def size(text: str) -> tuple[int, int]:
    """``HxW``, both at least 1."""
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not HxW; use e.g. 28x28") from exc
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both sides must be at least 1 pixel")
    return h, w


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def count(text: str) -> int:
    """A count of workers: 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must lie in (0, 1], e.g. 0.99 for 99%")
    return value


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
