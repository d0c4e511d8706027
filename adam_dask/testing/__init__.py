"""Helpers for tests, notebooks and benchmarks: small synthetic datasets and real faults.

Synthetic data
    :func:`synthetic_digits` draws learnable 28x28 "digits" (a bar whose angle is the class),
    :func:`write_idx` / :func:`write_mnist_like` write them as MNIST IDX files and
    :func:`synthetic_store` ingests them into a Zarr store, so a test trains on real files
    without downloading anything.

Faults from outside
    A machine failure is not a worker that exits by itself just after answering: it is a
    process killed or frozen by someone else, in the middle of whatever it was doing.
    :func:`worker_pids` asks each worker for its process id once; :func:`hard_kill` then sends
    ``SIGKILL`` from this process and waits until the scheduler has noticed, :func:`freeze` sends
    ``SIGSTOP`` (sockets stay open, nothing answers) and :func:`thaw` ``SIGCONT``.

Work under way while the faults land
    :class:`PushLoad` pushes small-integer deltas into a parameter server from a thread (their
    float32 sums are exact, so what was acknowledged can be compared with what the server holds);
    :func:`fit_in_background` runs ``Trainer.fit`` in a thread.

>>> images, labels = synthetic_digits(4, seed=1)
>>> images.shape, images.dtype.name, labels.shape
((4, 28, 28), 'uint8', (4,))
"""

from __future__ import annotations

import faulthandler
import gzip
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .netlinks import netns_problem
from .netns import NetnsCluster

logger = logging.getLogger(__name__)

__all__ = [
    "NetnsCluster",
    "PushLoad",
    "fit_in_background",
    "freeze",
    "hard_kill",
    "join_fit",
    "netns_problem",
    "push_on",
    "role_worker",
    "stop_and_check_sum",
    "synthetic_digits",
    "synthetic_store",
    "thaw",
    "thread_stacks",
    "wait_for_pushes",
    "wait_role_workers",
    "wait_workers_gone",
    "worker_pids",
    "write_idx",
    "write_mnist_like",
]


# -- synthetic data --------------------------------------------------------------------------------


def synthetic_digits(
    n: int, size: int = 28, classes: int = 10, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` learnable uint8 images ``(n, size, size)`` and their labels ``(n,)`` uint8.

    Class ``c`` draws a bar through the centre (jittered) at the angle ``pi * c / classes``,
    with pixel noise.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=n).astype(np.uint8)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    images = np.empty((n, size, size), dtype=np.uint8)
    for i, c in enumerate(labels):
        angle = np.pi * c / classes
        cx, cy = size / 2 + rng.normal(0, 1.0), size / 2 + rng.normal(0, 1.0)
        d = np.abs((xx - cx) * np.sin(angle) - (yy - cy) * np.cos(angle))
        img = np.clip(1.5 - d, 0, 1) * 255 + rng.normal(0, 12, (size, size))
        images[i] = np.clip(img, 0, 255).astype(np.uint8)
    return images, labels


def write_idx(
    path: str | Path, array: np.ndarray, *, gz: bool = True, magic: int | None = None
) -> Path:
    """Write ``array`` (uint8) as an IDX file (gzipped when ``gz``); ``magic`` overrides the
    header's magic number (to make a bad file)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) if magic is None else struct.pack(">I", magic)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    return path


def write_mnist_like(
    folder: str | Path, n_train: int = 300, n_test: int = 100, *, gz: bool = True, seed: int = 0
) -> Path:
    """A folder holding the four MNIST-style IDX files of a small synthetic dataset."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    for split, n, s in (("train", n_train, seed), ("t10k", n_test, seed + 1)):
        images, labels = synthetic_digits(n, seed=s)
        write_idx(folder / f"{split}-images-idx3-ubyte{ext}", images, gz=gz)
        write_idx(folder / f"{split}-labels-idx1-ubyte{ext}", labels, gz=gz)
    return folder


def synthetic_store(
    folder: str | Path, n_train: int = 512, n_test: int = 128, seed: int = 0
) -> str:
    """Ingest a synthetic MNIST-like dataset into ``folder/digits.zarr``; returns its path."""
    from ..data.ingest import ingest

    folder = Path(folder)
    src = write_mnist_like(folder / "src", n_train=n_train, n_test=n_test, seed=seed)
    ingest(str(src), str(folder / "digits.zarr"))
    return str(folder / "digits.zarr")


# -- faults from outside ---------------------------------------------------------------------------


def worker_pids(client: Any, addrs: Iterable[str] | None = None) -> dict[str, int]:
    """{worker address: process id} of ``addrs`` (all workers by default)."""
    workers = None if addrs is None else list(addrs)
    return {a: int(p) for a, p in client.run(os.getpid, workers=workers).items()}


def role_worker(
    scheduler: str,
    role: str,
    *,
    name: str,
    host: str = "127.0.0.1",
    nthreads: int = 2,
    memory_limit: str = "2GiB",
) -> subprocess.Popen:
    """A ``dask worker --resources ROLE=1`` process of its own, without a nanny, as a Kubernetes
    pod runs one: SIGTERM from outside (an eviction) makes it close its worker gracefully and
    exit; a replacement is another call. Its output is discarded."""
    return subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", scheduler]
        + ["--nthreads", str(nthreads), "--resources", f"{role}=1", "--no-nanny"]
        + ["--host", host, "--name", name, "--memory-limit", memory_limit],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_workers_gone(client: Any, addrs: Iterable[str], timeout: float = 60.0) -> float:
    """Block until the scheduler no longer lists ``addrs``; returns the seconds waited."""
    addrs = set(addrs)
    start = time.monotonic()
    while addrs & set(client.scheduler_info(n_workers=-1)["workers"]):
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"workers {sorted(addrs)} were still listed after {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - start


def wait_role_workers(client: Any, role: str, n: int, timeout: float = 120.0) -> list[str]:
    """Block until exactly ``n`` running workers have ``role`` (e.g. a nanny's fresh worker after
    :func:`hard_kill`, or one added or retired) and return their addresses; a replica count is
    taken from the workers present, so a test that asserts one waits for them first."""
    from adam_dask.cluster import workers_with_role

    deadline = time.monotonic() + timeout
    while len(found := workers_with_role(client, role)) != n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected {n} {role} workers after {timeout}s, found {found}")
        time.sleep(0.2)
    return found


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            logger.info("process %d is already gone (%s not sent)", pid, sig.name)


def hard_kill(
    client: Any, addrs: Iterable[str], *, wait: bool = True, timeout: float = 60.0
) -> None:
    """SIGKILL the worker processes at ``addrs`` from this process, as a machine failure would
    (no clean shutdown, actors and in-flight calls lost); with ``wait``, return once the
    scheduler has noticed they are gone. A nanny, if any, starts a fresh worker under a new
    address."""
    addrs = list(addrs)
    pids = worker_pids(client, addrs)
    _signal(pids.values(), signal.SIGKILL)
    logger.info("sent SIGKILL to %s", pids)
    if wait:
        wait_workers_gone(client, addrs, timeout)


def freeze(client: Any, addrs: Iterable[str]) -> dict[str, int]:
    """SIGSTOP the worker processes at ``addrs``: their sockets stay open and nothing answers,
    like a stalled VM or a long GC pause. Returns {address: pid} for :func:`thaw`."""
    pids = worker_pids(client, addrs)
    _signal(pids.values(), signal.SIGSTOP)
    logger.info("sent SIGSTOP to %s", pids)
    for pid in pids.values():
        _wait_stopped(pid)
    return pids


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Return once every thread of ``pid`` is stopped (a stop signal lands asynchronously: on a
    loaded machine a process went on answering requests for milliseconds after ``kill``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
        except OSError:  # gone, or no /proc here: nothing to wait for
            return
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    logger.warning("process %d was not seen stopped within %.0f s", pid, timeout)


def thaw(pids: dict[str, int] | Iterable[int]) -> None:
    """SIGCONT processes frozen by :func:`freeze`."""
    values = pids.values() if isinstance(pids, dict) else pids
    _signal(list(values), signal.SIGCONT)


# -- work under way --------------------------------------------------------------------------------


class PushLoad(threading.Thread):
    """Pushes small-integer deltas into ``server`` until :attr:`stop` is set.

    The deltas (a few drawn from ``seed``, used in turn) are integers 1-3, so any sum of them is
    exact in float32: :meth:`total` (the sum of the acknowledged pushes) must equal what the
    server gained, to the last bit. :attr:`times` holds each acknowledged push's (start, end)
    ``perf_counter``; :attr:`error` the exception that ended the loop, if one did.
    """

    def __init__(self, server: Any, seed: int, kinds: int = 4):
        super().__init__(daemon=True, name=f"push-load-{seed}")
        rng = np.random.default_rng(seed)
        self.server = server
        self.deltas = [rng.integers(1, 4, server.size).astype(np.float32) for _ in range(kinds)]
        self.counts = [0] * kinds
        self.times: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    @property
    def count(self) -> int:
        """Pushes acknowledged so far."""
        return len(self.times)

    def run(self) -> None:
        k = 0
        try:
            while not self.stop.is_set():
                i = k % len(self.deltas)
                t0 = time.perf_counter()
                self.server.push(self.deltas[i])
                t1 = time.perf_counter()
                self.counts[i] += 1
                self.times.append((t0, t1))
                k += 1
        except BaseException as exc:  # the caller reads it
            self.error = exc

    def total(self) -> np.ndarray:
        """The sum of the acknowledged pushes, float64 (exact)."""
        out = np.zeros(self.server.size, np.float64)
        for d, c in zip(self.deltas, self.counts, strict=True):
            out += c * d.astype(np.float64)
        return out

    def served_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the end of the first push started at or after ``t``."""
        for t0, t1 in list(self.times):
            if t0 >= t:
                return t1 - t
        return None


def push_on(pushers: list[PushLoad], more: int, timeout: float = 120.0) -> None:
    """Wait until ``pushers`` together acknowledged ``more`` pushes beyond their count now;
    AssertionError when one of them stops (with its error) or the time runs out."""
    target = sum(p.count for p in pushers) + more
    deadline = time.monotonic() + timeout
    while sum(p.count for p in pushers) < target:
        if not all(p.error is None and p.is_alive() for p in pushers):
            raise AssertionError(f"a pusher stopped: {[p.error for p in pushers]}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"fewer than {more} more pushes in {timeout}s; {_push_state(pushers)}"
            )
        time.sleep(0.02)


def _push_state(pushers: list[PushLoad]) -> str:
    """What a stalled push waits for, for the failure's message: each pusher's held pushes
    (and how many some copy may lack) and the server's figures (the copies' and the
    checkpoint's lag, the forwards, each node's shards)."""
    held = []
    for p in pushers:
        log = getattr(getattr(p.server, "_courier", None), "log", None)
        held.append(None if log is None else (len(log), log.unreplicated, log.nbytes))
    try:
        stats = pushers[0].server.stats() if pushers else None
    except Exception as exc:  # the message says it could not be read
        stats = repr(exc)
    return (
        f"load {os.getloadavg()}; held (pushes, unreplicated, bytes) per pusher {held}; "
        f"server stats {stats}"
    )


def stop_and_check_sum(server: Any, pushers: list[PushLoad]) -> None:
    """Stop ``pushers``, flush ``server`` and check it holds every push they were told was
    applied, exactly once, to the last bit (AssertionError otherwise)."""
    for p in pushers:
        p.stop.set()
        p.join(60)
    errors = [p.error for p in pushers if p.error is not None]
    if errors:
        raise AssertionError(f"pushers failed: {errors}")
    server.flush()
    np.testing.assert_array_equal(server.pull(), sum(p.total() for p in pushers))


def fit_in_background(trainer: Any, epochs: int) -> tuple[threading.Thread, dict]:
    """Start ``trainer.fit(epochs=epochs)`` in a daemon thread.

    Returns the thread and a dict that gets ``"history"`` when the fit returns or ``"error"``
    (the exception) when it raises.
    """
    box: dict = {}

    def target() -> None:
        try:
            box["history"] = trainer.fit(epochs=epochs)
        except BaseException as exc:  # the caller reads it
            box["error"] = exc

    th = threading.Thread(target=target, daemon=True, name="fit-in-background")
    th.start()
    return th, box


def join_fit(th: threading.Thread, client: Any, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for a fit started by :func:`fit_in_background` (thread
    ``th``) to return. A fit still running then is a stall: AssertionError with where every
    thread of this process and of each of ``client``'s workers waits, so that a run that
    stalled once says why."""
    th.join(timeout=timeout)
    if th.is_alive():
        raise AssertionError(
            f"the fit did not end within {timeout} s (a stall)\n{thread_stacks(client)}"
        )


def _stacks_here() -> str:
    """Every thread's stack in this process, most recent call first, each headed
    ``--- thread NAME``. Read by :mod:`faulthandler`, which walks the threads without making a
    Python object: ``sys._current_frames()`` makes frames while it holds the interpreter's
    thread lock and on CPython 3.11 can deadlock there (gh-106883; docs/setup.md), and a
    stall's report must not freeze the worker it asks."""
    names = {t.ident: t.name for t in threading.enumerate()}

    def header(m: re.Match) -> str:
        ident = int(m.group(1), 16)
        return f"--- thread {names.get(ident, m.group(1))} ({m.group(1)}, most recent call first):"

    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read()
    return _THREAD_HEADER.sub(header, text).rstrip()


_THREAD_HEADER = re.compile(
    r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):", re.M
)


def thread_stacks(client: Any, timeout: float = 30.0) -> str:
    """The stack of every thread of this process and of each worker of ``client`` (the
    workers' own report; one that does not answer within ``timeout`` says so)."""
    parts = [f"=== this process ({os.getpid()})", _stacks_here()]
    got: dict = {}

    def ask() -> None:  # on a daemon thread: a frozen worker must not hold the report
        try:
            got["stacks"] = client.run(_stacks_here, on_error="return")
        except Exception as exc:  # best effort: the stall may be the cluster's
            got["error"] = exc

    asker = threading.Thread(target=ask, daemon=True, name="thread-stacks")
    asker.start()
    asker.join(timeout)
    stacks = got.get("stacks") or {
        "?": f"the workers did not report within {timeout} s: {got.get('error')!r}"
    }
    for addr, text in sorted(stacks.items()):
        parts += [f"=== worker {addr}", str(text)]
    return "\n".join(parts)


def wait_for_pushes(trainer: Any, box: dict, n: int, timeout: float = 300.0) -> None:
    """Wait until the parameter server of ``trainer`` (fitting in the background:
    :func:`fit_in_background`'s ``box``) has applied ``n`` shard updates: a fault sent then
    falls mid-training. AssertionError when the fit ended first or ``timeout`` passed (with
    the count reached)."""
    deadline = time.monotonic() + timeout
    applied = 0
    while time.monotonic() < deadline:
        if "error" in box or "history" in box:
            raise AssertionError(f"fit ended before {n} shard updates: {box}")
        if trainer.server is not None:
            applied = trainer.server.stats()["pushes_applied"]
            if applied >= n:
                return
        time.sleep(0.1)
    raise AssertionError(f"{applied} shard updates in {timeout} s, fewer than {n}")
