"""Helpers shared by the benchmark scripts: where MNIST is, a ready MNIST store,
:func:`engine_rate` (the newest engine rate stored), and :func:`record`, which prints a
benchmark's JSON line and appends it, stamped with the date, the commit and the machine's CPU
count, to ``benchmarks/results/NAME.jsonl`` (committed; the figures of the README and docs/ are
generated from those files by ``benchmarks/report.py``)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from adam_dask.data.ingest import mnist_location

RESULTS = Path(__file__).resolve().parent / "results"


def _commit() -> str:
    if os.environ.get("ADAM_DASK_COMMIT"):  # a copy of the tree without its .git (another machine)
        return os.environ["ADAM_DASK_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def record(name: str, result: dict, *, save: bool = True) -> dict:
    """Print ``result`` as one JSON line on stdout and append it to
    ``benchmarks/results/{name}.jsonl`` with ``benchmark``, ``date`` (UTC), ``commit`` and
    ``cpus``, and ``load_at_record`` (os.getloadavg()) when ``result`` records no load of its own
    (``report.py`` shows each line's load, and makes no claim of speed from a busy machine's).
    Returns the stamped line."""
    line = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _commit(),
        "cpus": os.cpu_count(),
        **_rounded(result),
    }
    if not any(k in result for k in ("load", "load_average", "load_before", "load_after")):
        line["load_at_record"] = [round(v, 2) for v in os.getloadavg()]
    text = json.dumps(line)
    print(text)
    sys.stdout.flush()
    if save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / f"{name}.jsonl", "a") as f:
            f.write(text + "\n")
    return line


def engine_rate(key: str) -> tuple[float | None, str]:
    """The newest non-zero ``key`` (``images_per_s``, ``images_per_s_1thread``) of
    ``benchmarks/results/engine.jsonl``, this machine's engine rate that other benchmarks pace
    their emulated replicas by, and where it came from (``engine.jsonl DATE COMMIT``); ``(None,
    "missing")`` when the file or the key is not there."""
    try:
        lines = [
            json.loads(s) for s in (RESULTS / "engine.jsonl").read_text().splitlines() if s.strip()
        ]
    except OSError:
        return None, "missing"
    for line in reversed(lines):
        if line.get(key):
            return float(line[key]), (
                f"engine.jsonl {line.get('date', '?')} {line.get('commit', '?')}"
            )
    return None, "missing"


def wait_for_training(client, stop) -> None:
    """Block until the replicas' first progress report reaches the scheduler (or ``stop``, a
    threading.Event, is set): faults sent from then on land mid-training."""
    while not stop.is_set() and not client.get_events("adam-progress"):
        stop.wait(0.2)


def mnist_folder() -> str:
    """The folder of the four official MNIST files ($ADAM_DASK_MNIST, shared/, or the mirror)."""
    return mnist_location()


def mnist_store(path: str | None = None) -> str:
    """A Zarr store of real MNIST, ingested once into a temporary folder (or ``path``)."""
    from adam_dask.data.datasets import open_split
    from adam_dask.data.ingest import ingest
    from adam_dask.errors import DatasetError

    path = path or os.path.join(tempfile.gettempdir(), "adam-dask-bench-mnist.zarr")
    try:
        open_split(path, "train")
        open_split(path, "test")
    except DatasetError:
        ingest("mnist", path, overwrite=True)
    return path


def mnist_subset_store(n_train: int, n_test: int = 10000) -> str:
    """A Zarr store of the first ``n_train`` / ``n_test`` real MNIST images (a shorter epoch for
    smoke runs), ingested once into a temporary folder; the full sets when the counts reach
    60000 / 10000."""
    from adam_dask.data.datasets import open_split
    from adam_dask.data.ingest import MNIST_FILES, ingest, read_idx
    from adam_dask.errors import DatasetError
    from adam_dask.testing import write_idx

    if n_train >= 60000 and n_test >= 10000:
        return mnist_store()
    folder = Path(tempfile.gettempdir()) / f"adam-dask-bench-mnist-{n_train}-{n_test}"
    store = folder / "mnist.zarr"
    try:
        open_split(str(store), "train")
        open_split(str(store), "test")
        return str(store)
    except DatasetError:
        pass
    root = mnist_folder()
    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    for split, n, prefix in (("train", n_train, "train"), ("test", n_test, "t10k")):
        images, labels = MNIST_FILES[split]
        write_idx(src / f"{prefix}-images-idx3-ubyte.gz", read_idx(f"{root}/{images}")[:n])
        write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", read_idx(f"{root}/{labels}")[:n])
    ingest(str(src), str(store), overwrite=True)
    return str(store)


def load_mnist_arrays(store: str):
    """(x_train, y_train, x_test, y_test) of a dataset store: uint8 images, int64 labels."""
    import numpy as np

    from adam_dask.data.datasets import open_split

    xtr, ytr = open_split(store, "train").read()
    xte, yte = open_split(store, "test").read()
    return xtr, ytr.astype(np.int64), xte, yte.astype(np.int64)


def torch_model(torch, spec_activation: str = "relu"):
    """The paper's MNIST network (conv5x5:10, pool, conv5x5:20, pool, fc400, fc400, fc10) in
    PyTorch, what a user would write; parameter names match adam_dask's."""
    nn = torch.nn
    act = {"relu": nn.ReLU, "tanh": nn.Tanh}[spec_activation]
    return nn.Sequential(
        nn.Conv2d(1, 10, 5),
        act(),
        nn.MaxPool2d(2),
        nn.Conv2d(10, 20, 5),
        act(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(320, 400),
        act(),
        nn.Linear(400, 400),
        act(),
        nn.Linear(400, 10),
    )


def torch_accuracy(torch, model, x, y) -> float:
    """Accuracy of ``model`` (put in eval mode) on float images ``x`` (a tensor) with labels
    ``y`` (numpy), in chunks of 1000 images."""
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x[i : i + 1000]).argmax(1) for i in range(0, len(x), 1000)])
    return float((pred.numpy() == y).mean())


def torch_fit_to_target(
    xtr,
    ytr,
    xte,
    yte,
    *,
    target: float,
    max_epochs: int,
    threads: int,
    lr: float,
    lr_decay: float,
    batch: int = 32,
    activation: str = "relu",
    seed: int = 0,
) -> dict:
    """Train the network in PyTorch (SGD, ``batch``) until test accuracy >= ``target``."""
    import time

    import numpy as np
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    model = torch_model(torch, activation)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    lossf = torch.nn.CrossEntropyLoss()
    X = torch.from_numpy(xtr[:, None].astype(np.float32) / 255)
    Y = torch.from_numpy(ytr)
    Xt = torch.from_numpy(xte[:, None].astype(np.float32) / 255)
    t0 = time.perf_counter()
    curve, reached = [], None
    for epoch in range(max_epochs):
        for g in opt.param_groups:
            g["lr"] = lr * lr_decay**epoch
        model.train()
        perm = torch.randperm(len(X))
        for i in range(0, len(X), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            lossf(model(X[idx]), Y[idx]).backward()
            opt.step()
        acc = torch_accuracy(torch, model, Xt, yte)
        curve.append(round(acc, 4))
        if acc >= target:
            reached = time.perf_counter() - t0
            break
    return {
        "seconds_to_target": reached,
        "epochs": len(curve),
        "curve": curve,
        "seconds": time.perf_counter() - t0,
        "torch": torch.__version__,
    }


def train_cli(store: str, *flags: str) -> tuple[list[dict], dict, float]:
    """Run ``adam-dask train --data STORE --no-progress --metrics-out F FLAGS...`` as a user
    would: (the history it appended to F, one record per epoch; its result, the JSON line it
    printed last; wall seconds, the cluster's start included). Exits with its last error lines
    when it fails."""
    import time

    metrics = os.path.join(tempfile.mkdtemp(prefix="adam-train-"), "history.jsonl")
    cmd = [sys.executable, "-m", "adam_dask.cli", "train", "--data", store, "--no-progress"]
    cmd += ["--metrics-out", metrics, *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"adam-dask train failed: {proc.stderr.strip().splitlines()[-3:]}")
    with open(metrics) as f:
        history = [json.loads(line) for line in f if line.strip()]
    return history, json.loads(proc.stdout.strip().splitlines()[-1]), wall
