"""Helpers shared by the benchmark scripts: where MNIST is, and a ready MNIST store."""

from __future__ import annotations

import os
import tempfile

from adam_dask.data.ingest import mnist_location


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
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model(Xt[i : i + 1000]).argmax(1) for i in range(0, len(Xt), 1000)])
        acc = float((pred.numpy() == yte).mean())
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
