"""The error hierarchy of adam_dask.

Every error says what was wrong and what to do, in one line, so the CLI can print
``error: <message>`` and exit non-zero without a traceback. Typed attributes carry the details
for programs that catch them. The message never shows a credential: URLs in it lose their user
information and signed query values, and the secrets the process knows are blanked
(:mod:`adam_dask._secrets`).
"""

from __future__ import annotations

from ._secrets import process_redactor


class AdamError(Exception):
    """Base class of every error adam_dask raises on purpose.

    Parameters
    ----------
    message : str
        What was wrong.
    hint : str, optional
        What to do about it; appended to the message after ``": "``-style punctuation.
    """

    def __init__(self, message: str, hint: str | None = None):
        redact = process_redactor()
        self.message = redact(message)
        self.hint = redact(hint) if hint else hint
        super().__init__(self.message if not self.hint else f"{self.message}; {self.hint}")


class ConfigError(AdamError, ValueError):
    """An argument or configuration value is invalid."""


class SourceError(AdamError, ValueError):
    """An ingest source is unreadable, corrupt or inconsistent."""

    def __init__(self, message: str, hint: str | None = None, *, path: str | None = None):
        self.path = path
        super().__init__(message, hint)


class DatasetError(AdamError, ValueError):
    """A dataset store is missing, incomplete or malformed."""

    def __init__(self, message: str, hint: str | None = None, *, url: str | None = None):
        self.url = url
        super().__init__(message, hint)


class DestinationExistsError(AdamError, FileExistsError):
    """A destination already holds data and overwriting was not asked for."""


class StorageError(AdamError, OSError):
    """Object storage could not be reached or refused an operation."""


class ModelSpecError(AdamError, ValueError):
    """A network spec does not parse, or its shapes do not fit; names the layer."""

    def __init__(self, message: str, hint: str | None = None, *, layer: int | None = None):
        self.layer = layer
        super().__init__(message, hint)


class InputShapeError(AdamError, ValueError):
    """An array given to the model or a kernel has the wrong shape or dtype."""


class UpdateRejected(AdamError, ValueError):
    """The parameter server refused an update (non-finite values, wrong length); nothing changed."""

    def __init__(self, message: str, hint: str | None = None, *, shard: int | None = None):
        self.shard = shard
        super().__init__(message, hint)


class ShardUnavailable(AdamError, RuntimeError):
    """Every copy of a parameter shard is lost, or fail-over did not finish in time."""

    def __init__(self, message: str, hint: str | None = None, *, shard: int | None = None):
        self.shard = shard
        super().__init__(message, hint)


class CheckpointError(AdamError, OSError):
    """A checkpoint is missing, incomplete, or cannot be written."""


class ClusterError(AdamError, RuntimeError):
    """The Dask cluster lacks the workers or roles a job needs."""


class PartitionError(ConfigError):
    """A model partition plan that cannot run: a partition over its worker's memory, or more
    partitions than layers or TRAIN workers."""

    def __init__(self, message: str, hint: str | None = None, *, partition: int | None = None):
        self.partition = partition
        super().__init__(message, hint)
