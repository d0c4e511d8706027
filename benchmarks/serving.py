"""Benchmark: one augmented epoch of MNIST through the DataServers, against its peers.

Prints one JSON line and appends it to ``benchmarks/results/serving.jsonl`` (with date, commit
and CPU count):

* ``augmented_images_per_s``: a consumer task on the TRAIN worker drains one epoch of the real
  MNIST store, augmented (affine + elastic, the ``adam.augment`` ranges), served by the DataServer
  actors on the DATA workers of the embedded cluster (peer-to-peer, ``prefetch`` in flight);
* ``raw_read_images_per_s``: reading the same store chunk by chunk with no augmentation
  (the storage limit);
* ``torch_loader_images_per_s``: a PyTorch ``DataLoader`` (``num_workers=2``) whose Dataset
  applies the same augmentation the way a user writes it (scipy.ndimage affine_transform,
  gaussian_filter and map_coordinates, bilinear); ``null`` with a note when torch or scipy is
  missing;
* ``stall_fraction``: the share of time a simulated training replica (consuming at
  ``--train-rate`` images/s, modelled with sleeps) spent waiting for data over one epoch.

Usage: ``python benchmarks/serving.py [--mnist DIR] [--torch-images N] [--train-rate R]``.
The MNIST IDX folder comes from ``--mnist``, else ``$ADAM_DASK_MNIST``, a shared/datasets/mnist
folder beside the checkout, or the public mirror.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import numpy as np

logger = logging.getLogger("benchmarks.serving")


def consume(service, epoch: int, train_rate: float | None = None, warmup_batches: int = 0):
    """Drain one epoch (replica 0 of 1) in a task; with ``train_rate`` sleep like a trainer."""
    if warmup_batches:
        warm = service.stream(0, 1, epoch + 1000)
        for i, _ in enumerate(warm):
            if i + 1 >= warmup_batches:
                break
        warm.close()
    stream = service.stream(0, 1, epoch)
    t0 = time.perf_counter()
    n = 0
    for x, y in stream:
        n += len(y)
        if train_rate:
            time.sleep(len(y) / train_rate)
    seconds = time.perf_counter() - t0
    return {"images": n, "seconds": seconds, **stream.stats()}


def raw_read(url: str) -> float:
    """Images/s reading the whole train split chunk by chunk, no augmentation."""
    from adam_dask.data.datasets import open_split

    s = open_split(url, "train")
    t0 = time.perf_counter()
    n = 0
    for start in range(0, len(s), s.chunk_images):
        images, labels = s.read(start, min(len(s), start + s.chunk_images))
        n += len(images)
    return n / (time.perf_counter() - t0)


class _TorchAugmented:
    """A map-style Dataset: the same affine + elastic augmentation with numpy/scipy."""

    def __init__(self, images, labels, aug, seed=0):
        self.images, self.labels, self.aug, self.seed = images, labels, aug, seed

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        import torch
        from scipy import ndimage

        a = self.aug
        rng = np.random.default_rng([self.seed, int(i)])
        img = self.images[i].astype(np.float32) / 255.0
        H, W = img.shape
        angle = np.deg2rad(rng.uniform(-a.rotation, a.rotation))
        scale = 1 + rng.uniform(-a.scale, a.scale)
        shear = rng.uniform(-a.shear, a.shear)
        tx, ty = rng.uniform(-a.translation, a.translation, size=2)
        c, s = np.cos(angle), np.sin(angle)
        m = np.array([[c, c * shear - s], [s, s * shear + c]]) * scale  # (x, y) forward map
        minv = np.linalg.inv(m)
        minv_rc = minv[::-1, ::-1]  # (row, col) order
        centre = np.array([(H - 1) / 2, (W - 1) / 2])
        offset = centre - minv_rc @ (centre + np.array([ty, tx]))
        out = ndimage.affine_transform(img, minv_rc, offset=offset, order=1, cval=0.0)
        if a.elastic_alpha > 0:
            dx = (
                ndimage.gaussian_filter(
                    rng.uniform(-1, 1, (H, W)), a.elastic_sigma, mode="constant", truncate=3.0
                )
                * a.elastic_alpha
            )
            dy = (
                ndimage.gaussian_filter(
                    rng.uniform(-1, 1, (H, W)), a.elastic_sigma, mode="constant", truncate=3.0
                )
                * a.elastic_alpha
            )
            yy, xx = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
            out = ndimage.map_coordinates(out, [yy + dy, xx + dx], order=1, cval=0.0)
        x = torch.from_numpy(np.clip(out, 0, 1).astype(np.float32)[None])
        return x, int(self.labels[i])


def torch_loader(images, labels, aug, n_images: int, batch_size: int) -> tuple[float | None, str]:
    try:
        import scipy  # noqa: F401
        import torch
        from torch.utils.data import DataLoader, Subset
    except ImportError as exc:
        return None, (
            f"torch/scipy missing ({exc.name}): pip install torch==2.13.0 scipy "
            "to compare with a PyTorch DataLoader"
        )
    torch.set_num_threads(1)
    ds = Subset(_TorchAugmented(images, labels, aug), range(min(n_images, len(images))))
    loader = DataLoader(
        ds, batch_size=batch_size, shuffle=True, num_workers=2, persistent_workers=False
    )
    n = 0
    t0 = time.perf_counter()
    for x, y in loader:
        n += len(y)
    return n / (time.perf_counter() - t0), f"torch {torch.__version__}, {n} images"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--mnist", default=None, help="MNIST folder (default: adam-dask's `mnist` lookup)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="default: adam.serving.batch-size")
    p.add_argument("--data-nodes", type=int, default=1)
    p.add_argument(
        "--torch-images",
        type=int,
        default=20000,
        help="images the PyTorch DataLoader augments (a rate is reported)",
    )
    p.add_argument(
        "--train-rate",
        type=float,
        default=5000.0,
        help="images/s of the simulated training replica for the stall fraction",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    from _common import record

    import adam_dask
    from adam_dask import config
    from adam_dask.data import Augment, DataService
    from adam_dask.data.datasets import load_arrays
    from adam_dask.data.ingest import ingest

    aug = Augment.from_config()
    batch_size = int(config.get("serving.batch-size", args.batch_size))
    with tempfile.TemporaryDirectory() as tmp:
        url = os.path.join(tmp, "mnist.zarr")
        ingest(args.mnist or "mnist", url)
        raw = raw_read(url)
        with adam_dask.cluster.local(
            ps_nodes=0, data_nodes=args.data_nodes, trainers=1, trainer_threads=1
        ) as client:
            service = DataService.create(client, url, augment=aug, batch_size=batch_size)
            try:
                fast = client.submit(
                    consume, service, 0, None, 8, resources={"TRAIN": 1}, pure=False
                ).result()
                paced = client.submit(
                    consume, service, 1, args.train_rate, 0, resources={"TRAIN": 1}, pure=False
                ).result()
                served = service.stats()
            finally:
                service.close()
        images, labels = load_arrays(url, "train")
    torch_rate, torch_note = torch_loader(images, labels, aug, args.torch_images, batch_size)
    augmented = fast["images"] / fast["seconds"]
    result = {
        "images": fast["images"],
        "batch_size": batch_size,
        "data_nodes": args.data_nodes,
        "augment": {
            "rotation": aug.rotation,
            "translation": aug.translation,
            "scale": aug.scale,
            "shear": aug.shear,
            "elastic_alpha": aug.elastic_alpha,
            "elastic_sigma": aug.elastic_sigma,
        },
        "augmented_images_per_s": round(augmented, 1),
        "raw_read_images_per_s": round(raw, 1),
        "torch_loader_images_per_s": None if torch_rate is None else round(torch_rate, 1),
        "speedup_vs_torch": None if torch_rate is None else round(augmented / torch_rate, 2),
        "stall_fraction": round(paced["stall_fraction"], 4),
        "stall_train_rate_images_per_s": args.train_rate,
        "unpaced_stall_fraction": round(fast["stall_fraction"], 4),
        "images_served": served["images_served"],
        "torch_note": torch_note,
    }
    record("serving", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
