"""URLs to filesystems and Zarr stores: local paths, ``file://``, ``s3://``, ``memory://``, any fsspec URL.

Storage options come from the caller (``--storage-options JSON`` on the CLI); the standard AWS
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ...) are read by
botocore itself. ``AWS_ENDPOINT_URL`` is also passed to s3fs explicitly, for older botocore.

Every filesystem and store of the package is opened through :func:`options_for`, which tells the
process's redactor the credentials it is given (:mod:`adam_dask._secrets`): no log line of the
process shows them, and errors show URLs without their credentials (:func:`redact_url`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from ._secrets import redact_url, remember
from .errors import StorageError

__all__ = [
    "describe_storage_error",
    "filesystem",
    "join_url",
    "normalize_url",
    "options_for",
    "protocol",
    "redact_url",
    "zarr_store",
]

logger = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """A local path becomes an absolute path; ``file://`` is stripped; other URLs are kept."""
    url = os.fspath(url)
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    return url.rstrip("/")


def join_url(base: str, *names: str) -> str:
    """``base`` and ``names`` joined with ``/`` (a URL or a POSIX path) or the OS separator (a
    local path given without a protocol): the one join of the package.

    >>> join_url("s3://bucket/store/", "train", "zarr.json")
    's3://bucket/store/train/zarr.json'
    """
    if "://" in base or base.startswith("/"):
        return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)])
    return os.path.join(base, *names)


def protocol(url: str) -> str:
    url = normalize_url(url)
    return url.split("://", 1)[0] if "://" in url else "file"


def options_for(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """Storage options for ``url``: the caller's, plus ``AWS_ENDPOINT_URL`` for ``s3://``.
    Their credentials are secrets of this process from now on (its logs never show them)."""
    remember(storage_options)
    opts = dict(storage_options or {})
    if (
        protocol(url) in ("s3", "s3a")
        and os.environ.get("AWS_ENDPOINT_URL")
        and "endpoint_url" not in opts
        and "endpoint_url" not in opts.get("client_kwargs", {})
    ):
        opts["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    return opts


def filesystem(
    url: str, storage_options: dict | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """``(fs, path)`` for ``url``."""
    url = normalize_url(url)
    try:
        return url_to_fs(url, **options_for(url, storage_options))
    except (ImportError, ValueError) as exc:
        raise StorageError(
            f"cannot open {url}: {exc}", "check the URL scheme and install its fsspec backend"
        ) from exc


def zarr_store(url: str, storage_options: dict | None = None, *, read_only: bool = True):
    """A Zarr v3 store for ``url``."""
    from zarr.storage import FsspecStore, LocalStore

    url = normalize_url(url)
    if "://" not in url:
        if read_only and not os.path.exists(url):
            # LocalStore would silently create nothing and fail later with a vague message
            raise FileNotFoundError(url)
        return LocalStore(url, read_only=read_only)
    return FsspecStore.from_url(
        url, storage_options=options_for(url, storage_options), read_only=read_only
    )


def describe_storage_error(url: str, exc: BaseException) -> StorageError:
    """One clear :class:`StorageError` for a failure that reached storage at ``url``."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return StorageError(
        f"storage at {url} failed: {text}",
        "check the endpoint, the credentials and the network, then try again",
    )
