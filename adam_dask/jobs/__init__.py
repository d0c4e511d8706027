"""Running a command as a batch job: the contract shared by ``adam-dask`` and ``pipelines/``.

A job prints progress and logs on stderr and, as its last line on stdout, one JSON object of
its results. A failure prints one line ``error: <what was wrong>; <what to do>`` on stderr, no
traceback, and exits with a status a scheduler of jobs can act on:

====  =====================================================================================
0     done
1     an unforeseen failure (a bug); ``-v`` shows the traceback
2     bad input: a diagnosed error (:class:`~adam_dask.errors.AdamError`, whose message says
      what to do), or a file, URL or service that is not there or refuses (an ``OSError``)
130   interrupted (SIGINT, Ctrl-C)
143   terminated (SIGTERM, e.g. Kubernetes stopping the pod); cleaned up like an interrupt
====  =====================================================================================

Credentials never reach the output: :class:`Redactor` (:mod:`adam_dask._secrets`) replaces the
secret values of storage options, of the AWS environment variables, and passwords written into
URLs (``scheme://user:password@host``) with ``***`` in the result line, the error line and every
log record of the process.

>>> r = Redactor([{"key": "AKIAEXAMPLE", "secret": "wJalrXUtnFEMI"}], environ={})
>>> r("signed with wJalrXUtnFEMI for https://bob:hunter22@example.org/x")
'signed with *** for https://***@example.org/x'
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from .._secrets import Redactor, install, process_redactor
from ..errors import AdamError

logger = logging.getLogger(__name__)

__all__ = [
    "EXIT_ERROR",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "ArgumentParser",
    "Redactor",
    "Terminated",
    "count",
    "fraction",
    "json_object",
    "non_negative_float",
    "positive_float",
    "positive_int",
    "run_job",
    "setup_logging",
    "size",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

# -- command lines ---------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
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


def _finite(text: str) -> float | None:
    """``text`` as a float, None when it is not finite; an argparse error when no number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    return value if math.isfinite(value) else None


def positive_float(text: str) -> float:
    value = _finite(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0")
    return value


def server_optimizer(text: str) -> str:
    """A server optimizer's name (``sum``, ``nesterov``, either ``+staleness``)."""
    from ..errors import ConfigError
    from ..ps.protocol.optimizer import ServerOptimizer

    try:
        return ServerOptimizer.resolve(text).name
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must lie in (0, 1], e.g. 0.99 for 99%")
    return value


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the job unwinds like an interrupt (its cleanup runs)."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def setup_logging(verbose: int, redactor: Redactor) -> None:
    """Log on stderr: warnings (0), this package's info (1) or debug and Dask's own logs of this
    process (2), every record redacted and, below ``-v``, on one line without its traceback
    (when the process has no logging set up yet). Worker processes started from here keep Dask's logs at
    ``critical`` (their task-failure records print task arguments, storage options included)
    unless ``DASK_DISTRIBUTED__LOGGING__DISTRIBUTED`` says otherwise."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    for secret in redactor.secrets:  # every record of the process, whatever its handler
        process_redactor().add(secret)
    install()

    def clean(record: logging.LogRecord) -> bool:
        redactor.filter(record)
        if not verbose:  # one line per record; -v shows the tracebacks
            record.exc_info = record.exc_text = record.stack_info = None
        return True

    root = logging.getLogger()
    if not root.handlers:  # a program that embeds the job (a test) keeps its own logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(clean)
        root.addHandler(handler)
        root.setLevel(level)
    dask_level = logging.INFO if verbose >= 2 else logging.CRITICAL
    for name in ("distributed", "tornado", "asyncio", "bokeh"):
        lg = logging.getLogger(name)
        lg.setLevel(dask_level)
        for h in lg.handlers:  # distributed installs its own handler on its logger
            h.addFilter(clean)
    os.environ.setdefault("DASK_DISTRIBUTED__LOGGING__DISTRIBUTED", "critical")


def run_job(
    func: Callable[[], dict],
    redactor: Redactor,
    *,
    verbose: int = 0,
    out: Callable[[str], None] | None = None,
) -> int:
    """Run ``func`` as a job; returns the exit status (see the module docstring).

    The result goes to ``out`` (default: stdout) as one JSON line; a failure writes one
    ``error:`` line to stderr. SIGTERM is handled like SIGINT while the job runs (in the main
    thread), and a background thread that dies is logged as one warning, not a traceback.
    """
    out = out or (lambda s: print(s, flush=True))

    def thread_failed(hook: Any) -> None:  # a background thread's failure is logged, one line
        if hook.exc_type is not SystemExit:
            logger.warning(
                "background thread %s failed: %s: %s",
                getattr(hook.thread, "name", "?"),
                hook.exc_type.__name__,
                hook.exc_value,
                exc_info=(hook.exc_type, hook.exc_value, hook.exc_traceback) if verbose else None,
            )

    previous_hook, threading.excepthook = threading.excepthook, thread_failed
    previous = None
    if hasattr(signal, "SIGTERM"):
        try:
            previous = signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not the main thread: leave SIGTERM alone
            previous = None
    try:
        result = func()
    except AdamError as exc:
        _error(redactor, str(exc))
        return EXIT_ERROR
    except OSError as exc:  # a file, a URL or a service that is not there or refuses
        if verbose:
            logger.exception("storage or network failure")
        first = str(exc).splitlines()[0] if str(exc) else ""
        _error(
            redactor,
            f"{type(exc).__name__}: {first}; check the URL, the endpoint, the credentials "
            "and the network",
        )
        return EXIT_ERROR
    except Terminated:
        _error(
            redactor, "terminated (SIGTERM); completed work (checkpoints, finished stores) is kept"
        )
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        _error(redactor, "interrupted; completed work (checkpoints, finished stores) is kept")
        return EXIT_INTERRUPTED
    except Exception as exc:  # anything unforeseen still gets one line, not a traceback
        if verbose:
            logger.exception("unexpected failure")
        first = str(exc).splitlines()[0] if str(exc) else ""
        _error(redactor, f"{type(exc).__name__}: {first}; run again with -v for details")
        return EXIT_FAILED
    finally:
        threading.excepthook = previous_hook
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    out(redactor(json.dumps(result, default=str)))
    return EXIT_OK


def _error(redactor: Redactor, message: str) -> None:
    sys.stderr.write(redactor(f"error: {message}") + "\n")
    sys.stderr.flush()
