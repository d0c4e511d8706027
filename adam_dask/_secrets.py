"""Credentials: the one place that knows what a secret looks like and keeps it out of what
the package shows, writes and logs.

Three forms, for three uses:

* :func:`redact_url`: a URL as it may be shown or stored: the user information
  (``scheme://user:password@host``) and the values of query parameters that carry credentials
  (``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``sig``, ``token``,
  ``key``, ...) become ``***``. Deterministic, so a stored URL (a manifest's data URL) never
  depends on what a process happened to know.
* :func:`redact_options`: a copy of storage options whose credential values (any key naming
  a key, secret, token, password, credential or session, in nested dicts such as
  ``client_kwargs`` too) are ``***``.
* :class:`Redactor`: text with URLs redacted, ``name: 'value'`` pairs of credential names
  blanked (the repr of a dict of options, botocore's request headers) and every *known* secret
  value replaced. A process knows the values of the credential options it was given
  (:func:`remember`, called by :func:`adam_dask.storage.options_for`, which every filesystem
  of the package goes through) and of the AWS variables of its environment.

:func:`install` makes every log record of the process pass through the process's redactor (a
record factory: the handlers Dask, botocore or a notebook add later are covered too), and what
Python prints itself (a thread's uncaught exception, a warning) when nobody changed how. The
package installs it in every process of a cluster: the CLI and any client that opens storage
(:func:`remember`), the embedded cluster's workers at start (``adam_dask._worker_preload``),
the scheduler with the PS controller and the dashboard plugins, and any worker of another
cluster when it first opens storage.

Logging is process-wide, so the redactor that serves it is too: one per process, holding only
values, never written anywhere.

>>> redact_url("https://bob:hunter22@example.org/x?X-Amz-Signature=abcd&part=2")
'https://***@example.org/x?X-Amz-Signature=***&part=2'
>>> redact_options({"key": "AKIA", "client_kwargs": {"aws_session_token": "t0k3n"}, "anon": False})
{'key': '***', 'client_kwargs': {'aws_session_token': '***'}, 'anon': False}
>>> r = Redactor([{"secret": "wJalrXUtnFEMI"}], environ={})
>>> r("signed with wJalrXUtnFEMI; {'token': 'abc', 'Key': 'd.zarr/zarr.json'}")
"signed with ***; {'token': '***', 'Key': 'd.zarr/zarr.json'}"
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "MASK",
    "Redactor",
    "SecretFilter",
    "install",
    "is_secret_name",
    "process_redactor",
    "redact_options",
    "redact_url",
    "redact_urls",
    "remember",
    "scrub",
    "secret_values",
]

logger = logging.getLogger(__name__)

MASK = "***"

# names whose values are credentials (s3fs, gcsfs, adlfs, botocore, presigned-URL spellings)
_SECRET_WORD = re.compile(
    r"key|secret|token|password|passwd|credential|session|signature|(?:^|[_-])(?:sas|sig)$",
    re.I,
)
# names that match a word above but hold no credential: botocore's object key ("Key") and its
# signing settings
_NOT_SECRET = frozenset({"Key", "signature_version", "KeyCount", "KeyMarker", "MaxKeys"})
# the environment variables that hold credentials
SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "DASK_GATEWAY__AUTH__KWARGS",
)
_SHORTEST_SECRET = 4  # shorter values would blank out ordinary words

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s\"'<>]+@")
_QUERY = re.compile(r"(?P<head>[?&;](?P<name>[\w.-]+)=)(?P<value>[^&;#\s\"'<>]+)")
# name: 'value', name='value', "name": "value", 'name': b'value' (reprs, JSON, headers)
_PAIR = re.compile(
    r"(?P<head>(?P<name>[A-Za-z_][\w.-]*)['\"]?\s*[:=]\s*b?(?P<q>['\"]))(?P<value>[^'\"\n]*)(?P=q)"
)
# the access key id in an AWS signature: "Credential=AKIA.../20260101/region/s3/aws4_request"
_AWS_CREDENTIAL = re.compile(r"(?P<head>Credential=)(?P<value>[^/,\s\"']+)")


def is_secret_name(name: Any) -> bool:
    """Whether an option, header or parameter called ``name`` holds a credential."""
    return isinstance(name, str) and name not in _NOT_SECRET and bool(_SECRET_WORD.search(name))


def _secret_in_text(name: str) -> bool:
    """Whether ``name: 'value'`` in free text is a credential: as :func:`is_secret_name`, but a
    bare ``key`` is Dask's task key there (an access key id given as ``key`` is a known value
    of the process, replaced as such)."""
    return name.lower() != "key" and is_secret_name(name)


def redact_url(url: str) -> str:
    """``url`` without its credentials: user information and credential query values are
    ``***``. Anything else (a path, a plain string) is returned unchanged."""
    if not isinstance(url, str) or ("@" not in url and "=" not in url):
        return url
    url = _USERINFO.sub(rf"\g<scheme>{MASK}@", url)
    return _QUERY.sub(
        lambda m: m["head"] + MASK if is_secret_name(m["name"]) else m[0],
        url,
    )


def redact_options(options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A copy of ``options`` with the values of credential names (nested too) set to ``***``
    and URLs redacted."""
    if options is None:
        return None
    out: dict[str, Any] = {}
    for k, v in options.items():
        if is_secret_name(k) and v is not None and not isinstance(v, bool):
            out[k] = MASK
        elif isinstance(v, Mapping):
            out[k] = redact_options(v)
        elif isinstance(v, str):
            out[k] = redact_url(v)
        else:
            out[k] = v
    return out


def secret_values(options: Mapping[str, Any] | None) -> set[str]:
    """The credential values in ``options``: the strings under credential names, at any
    depth (every string of a credential given as a dict, such as a service account's)."""
    found: set[str] = set()

    def every_string(v: Any) -> None:
        if isinstance(v, str):
            found.add(v)
        elif isinstance(v, Mapping):
            for x in v.values():
                every_string(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                every_string(x)

    def walk(opts: Mapping[str, Any]) -> None:
        for k, v in opts.items():
            if is_secret_name(k):
                every_string(v)
            elif isinstance(v, Mapping):
                walk(v)

    walk(options or {})
    return {s for s in found if len(s) >= _SHORTEST_SECRET}


def _env_secrets(env: Mapping[str, str]) -> set[str]:
    found: set[str] = set()
    for name in SECRET_ENV:
        value = env.get(name)
        if not value:
            continue
        if len(value) >= _SHORTEST_SECRET:
            found.add(value)
        try:  # dask-gateway's auth kwargs are a JSON object
            parsed = json.loads(value)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            found |= secret_values(parsed) | {
                v for v in parsed.values() if isinstance(v, str) and len(v) >= _SHORTEST_SECRET
            }
    return found


class Redactor:
    """Replaces credentials in text with ``***``: URLs' user information and credential query
    values, values of credential names in ``name: 'value'`` pairs, and the known secrets.

    Parameters
    ----------
    options : iterable of dict
        Storage options whose credential values are secrets (nested dicts too).
    environ : mapping, optional
        Where the AWS variables are read, at every call (default ``os.environ``).
    """

    def __init__(
        self,
        options: Iterable[Mapping[str, Any] | None] = (),
        environ: Mapping[str, str] | None = None,
    ):
        self._environ = environ
        self._secrets: set[str] = set()
        self._ordered: list[str] = []
        self._env_key: tuple = ()
        self._lock = threading.Lock()
        for opts in options:
            self.add_options(opts)

    def add(self, secret: str) -> None:
        """Treat ``secret`` as a credential from now on."""
        if isinstance(secret, str) and len(secret) >= _SHORTEST_SECRET:
            with self._lock:
                if secret not in self._secrets:
                    self._secrets.add(secret)
                    self._ordered = []

    def add_options(self, options: Mapping[str, Any] | None) -> None:
        """Treat the credential values of ``options`` as secrets from now on."""
        for s in secret_values(options):
            self.add(s)

    @property
    def secrets(self) -> frozenset[str]:
        """The secret values known now (given and from the environment)."""
        return frozenset(s for s in self._refresh_env() if s)

    def _refresh_env(self) -> list[str]:
        env = os.environ if self._environ is None else self._environ
        key = tuple(env.get(n) for n in SECRET_ENV)
        with self._lock:
            if not self._ordered or key != self._env_key:
                self._env_key = key
                every = self._secrets | _env_secrets(env)
                self._ordered = sorted(every, key=len, reverse=True) or [""]
            return self._ordered

    def __call__(self, text: str) -> str:
        if not text:
            return text
        text = redact_url(text)
        if "=" in text or ":" in text:
            text = _PAIR.sub(
                lambda m: m["head"] + MASK + m["q"] if _secret_in_text(m["name"]) else m[0], text
            )
            text = _AWS_CREDENTIAL.sub(rf"\g<head>{MASK}", text)
        for s in self._refresh_env():
            if s and s in text:
                text = text.replace(s, MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact ``record`` in place (message, arguments, traceback, stack); always keeps it."""
        _scrub_record(self, record)
        return True


class SecretFilter(logging.Filter):
    """A :mod:`logging` filter redacting every record with ``redactor`` (default: the
    process's, see :func:`process_redactor`)."""

    def __init__(self, redactor: Redactor | None = None):
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        _scrub_record(self.redactor or _PROCESS, record)
        return True


def _scrub_record(redactor: Redactor, record: logging.LogRecord) -> None:
    if getattr(record, "_adam_redacted", None) is redactor:
        return
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: keep what there is, redacted
        message = f"{record.msg} {record.args!r}"
    clean = redactor(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and record.exc_info[0] is not None:
        text = record.exc_text or "".join(traceback.format_exception(*record.exc_info)).rstrip()
        record.exc_text = redactor(text)
    elif record.exc_text:
        record.exc_text = redactor(record.exc_text)
    if record.stack_info:
        record.stack_info = redactor(record.stack_info)
    record._adam_redacted = redactor


# -- the process's redactor and its log records -------------------------------------------------

_PROCESS = Redactor()
_installed = False
_install_lock = threading.Lock()


def process_redactor() -> Redactor:
    """This process's redactor: the secrets :func:`remember` was given and the environment's."""
    return _PROCESS


def remember(options: Mapping[str, Any] | None) -> None:
    """Treat the credential values of ``options`` as secrets in this process (its logs), and
    redact its log records from now on (:func:`install`)."""
    if options:
        _PROCESS.add_options(options)
    install()


def install() -> None:
    """Redact every log record this process makes from now on (once per process; later calls
    do nothing)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        make = logging.getLogRecordFactory()

        def redacted_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make(*args, **kwargs)
            _scrub_record(_PROCESS, record)
            return record

        logging.setLogRecordFactory(redacted_record)
        # what Python prints itself, outside logging, when nobody changed how it prints
        if threading.excepthook is threading.__excepthook__:
            threading.excepthook = _print_thread_failure
        if warnings.showwarning is getattr(warnings, "_showwarning_orig", None):
            warnings.showwarning = _print_warning
        _installed = True


def _write_stderr(text: str) -> None:
    if sys.stderr is not None:
        try:
            sys.stderr.write(_PROCESS(text))
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stream: nothing to print on
            pass


def _print_thread_failure(args: Any) -> None:
    """``threading.excepthook``'s default print, redacted."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    failure = traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
    _write_stderr(f"Exception in thread {name}:\n{''.join(failure)}")


def _print_warning(
    message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """``warnings.showwarning``'s default print, redacted."""
    text = warnings.formatwarning(message, category, filename, lineno, line)
    if file is None:
        _write_stderr(text)
        return
    try:
        file.write(_PROCESS(text))
    except OSError:
        pass


def scrub(obj: Any, redactor: Redactor | None = None) -> Any:
    """``obj`` (JSON-like: dicts, lists, strings, numbers) with every string redacted by
    ``redactor`` (default: the process's). For what is shown (the dashboard), not stored."""
    r = redactor or _PROCESS
    if isinstance(obj, str):
        return r(obj)
    if isinstance(obj, Mapping):
        return {k: scrub(v, r) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, r) for v in obj]
    return obj


def redact_urls(obj: Any) -> Any:
    """``obj`` (JSON-like) with every string passed through :func:`redact_url` and credential
    options blanked: deterministic, for what is stored (a manifest)."""
    if isinstance(obj, str):
        return redact_url(obj)
    if isinstance(obj, Mapping):
        return {
            k: (
                redact_options(v)
                if k == "storage_options" and isinstance(v, Mapping)
                else redact_urls(v)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [redact_urls(v) for v in obj]
    return obj
