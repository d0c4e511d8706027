"""Shared fixtures: small synthetic datasets, a real S3 (moto's server on 127.0.0.1), real clusters."""

from __future__ import annotations

import gzip
import logging
import os
import struct
from pathlib import Path

import numpy as np
import pytest

logging.getLogger("werkzeug").setLevel(logging.ERROR)


# -- synthetic data ------------------------------------------------------------------------------


def synthetic_digits(n: int, size: int = 28, classes: int = 10, seed: int = 0):
    """``n`` learnable uint8 images (n, size, size): class ``c`` draws a bar at a class-specific
    position and angle, with noise; labels (n,) uint8."""
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


def write_idx(path: Path, array: np.ndarray, *, gz: bool = True, magic: int | None = None) -> Path:
    """Write ``array`` (uint8) as an IDX file (``.gz`` when ``gz``)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) if magic is None else struct.pack(">I", magic)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.tobytes()
    path = Path(path)
    if gz:
        path.write_bytes(gzip.compress(data, compresslevel=1))
    else:
        path.write_bytes(data)
    return path


def write_mnist_like(
    folder: Path, n_train: int = 300, n_test: int = 100, *, gz: bool = True, seed: int = 0
) -> Path:
    """A folder with the four MNIST-style IDX files of a small synthetic dataset."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    for split, n, s in (("train", n_train, seed), ("t10k", n_test, seed + 1)):
        images, labels = synthetic_digits(n, seed=s)
        write_idx(folder / f"{split}-images-idx3-ubyte{ext}", images, gz=gz)
        write_idx(folder / f"{split}-labels-idx1-ubyte{ext}", labels, gz=gz)
    return folder


def synthetic_store(folder: Path, n_train: int, n_test: int, seed: int = 0) -> str:
    """Ingest a synthetic MNIST-like dataset into ``folder/digits.zarr``; returns its path."""
    from adam_dask.data.ingest import ingest

    folder = Path(folder)
    src = write_mnist_like(folder / "src", n_train=n_train, n_test=n_test, seed=seed)
    ingest(str(src), str(folder / "digits.zarr"))
    return str(folder / "digits.zarr")


@pytest.fixture
def mnist_like(tmp_path) -> Path:
    return write_mnist_like(tmp_path / "src")


# -- S3: moto's real server on 127.0.0.1 ---------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (a free port); yields its storage options."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
    yield {"server": server, "options": opts, "endpoint": opts["endpoint_url"]}
    server.stop()


@pytest.fixture
def s3(s3_server, request):
    """A fresh bucket on the moto server; yields (bucket URL prefix, storage options)."""
    import s3fs

    opts = s3_server["options"]
    fs = s3fs.S3FileSystem(**opts)
    bucket = (
        "adam-"
        + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    )
    fs.mkdir(bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    yield f"s3://{bucket}", dict(opts)
    try:
        fs.rm(bucket, recursive=True)
    except Exception:
        pass


# -- clusters --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adam_cluster():
    """The embedded Adam cluster: 3 PS workers on distinct loopback hosts, 1 DATA, 2 TRAIN."""
    import adam_dask

    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        yield client


@pytest.fixture(scope="session")
def local_client():
    """A plain LocalCluster (2 workers, processes) for ingest and other role-free work."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            host="127.0.0.1",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


async def _die_soon():
    import asyncio

    # exit just after answering, so the call itself returns; the nanny restarts the worker empty
    asyncio.get_running_loop().call_later(0.05, os._exit, 1)


def kill_workers(client, addrs, timeout: float = 30) -> None:
    """Hard-kill workers, as a machine failure would (no clean shutdown, actors lost), and
    return once the scheduler has noticed they are gone."""
    import time

    addrs = list(addrs)
    client.run(_die_soon, workers=addrs)
    deadline = time.time() + timeout
    while set(addrs) & set(client.scheduler_info(n_workers=-1)["workers"]):
        if time.time() > deadline:
            raise TimeoutError(f"workers {addrs} did not die within {timeout}s")
        time.sleep(0.02)


def pytest_configure(config):
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(config.rootpath) / ".numba_cache"))
