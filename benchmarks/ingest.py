"""Benchmark: ingest the real MNIST files into a Zarr store, beside merely reading them.

Prints one JSON line: images/s and MB/s of `ingest` (decompress, parse, encode, write), and the
same for decompressing and parsing the IDX files alone (the limit ingest cannot beat).

    python benchmarks/ingest.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def main() -> None:
    from _common import mnist_folder

    from adam_dask.data.ingest import MNIST_FILES, ingest, read_idx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the best is reported")
    args = ap.parse_args()
    src = mnist_folder()
    files = [os.path.join(src, f) for pair in MNIST_FILES.values() for f in pair]

    read_s = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        arrays = [read_idx(f) for f in files]
        read_s.append(time.perf_counter() - t)
    n_images = sum(len(a) for a, f in zip(arrays, files) if "images" in f)
    nbytes = sum(a.nbytes for a in arrays)

    ingest_s = []
    tmp = tempfile.mkdtemp(prefix="adam-bench-ingest-")
    try:
        from distributed import Client, LocalCluster

        with (
            LocalCluster(
                processes=False,
                n_workers=1,
                threads_per_worker=os.cpu_count() or 2,
                dashboard_address=":0",
            ) as cluster,
            Client(cluster) as client,
        ):
            for i in range(args.repeat):
                t = time.perf_counter()
                summary = ingest(src, os.path.join(tmp, f"m{i}.zarr"), client=client)
                ingest_s.append(time.perf_counter() - t)
        stored = sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(os.path.join(tmp, "m0.zarr"))
            for f in fs
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert summary["images"] == n_images
    best_i, best_r = min(ingest_s), min(read_s)
    print(
        json.dumps(
            {
                "benchmark": "ingest",
                "images": n_images,
                "source": src,
                "ingest_seconds": round(best_i, 3),
                "ingest_images_per_s": round(n_images / best_i),
                "ingest_mb_per_s": round(nbytes / best_i / 1e6, 1),
                "read_idx_seconds": round(best_r, 3),
                "read_idx_images_per_s": round(n_images / best_r),
                "read_idx_mb_per_s": round(nbytes / best_r / 1e6, 1),
                "ratio_ingest_to_read": round(best_r / best_i, 3),
                "stored_mb": round(stored / 1e6, 1),
                "raw_mb": round(nbytes / 1e6, 1),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
