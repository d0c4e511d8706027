"""One data path: after a fit of every kind the paper moves, which transport carried the pushes
and pulls the PS nodes served. One JSON line, appended to benchmarks/results/data_path.jsonl.

    python benchmarks/data_path.py                    # real MNIST, a 4096-image subset
    python benchmarks/data_path.py --images 2048 --kinds sync,large

Each kind is one epoch of ``Trainer.fit`` on the embedded cluster (2 TRAIN workers, defaults
otherwise) over the first ``--images`` MNIST training images:

* ``offload``: the dense offload (``offload_dense=True``, momentum 0, ``push_every`` 128, where
  the paper's fc400 layers qualify: activations and errors travel instead of their deltas);
* ``partitions``: one replica over 2 TRAIN workers (``partitions=2``), ranged pushes and pulls;
* ``sync``: the synchronous baseline;
* ``large``: a 20M-parameter dense model (``fc4096,fc4096,fc10``, 80 MB a push, over the
  default 64 MiB replay budget);
* ``sigkill``: the paper's net with a PS primary's worker SIGKILLed from this process mid-fit
  (after the first pushes; ``killed`` names it, null when the fit ended first).

Per kind: ``by_transport`` summed over the live nodes (``{"plane": n, "dask": m}``), whether
every image was applied once (``images_applied == images``), the test accuracy, the seconds.
The goal (issue 37): ``plane > 0`` and ``dask == 0`` for every kind.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

from _common import mnist_subset_store, record

KINDS = ("offload", "partitions", "sync", "large", "sigkill")


def settings(kind: str) -> dict:
    if kind == "offload":
        return {"offload_dense": True, "momentum": 0.0, "push_every": 128}
    if kind == "partitions":
        return {"partitions": 2}
    if kind == "sync":
        return {"mode": "sync"}
    if kind == "large":
        return {"model": "fc4096,fc4096,fc10"}
    # the fault must land mid-fit: the replicas sleep 5 ms a mini-batch (about 2.5 s an epoch
    # of 4096 images longer), and the kill comes after the first pushes
    return {"slow_replicas": {0: 0.005, 1: 0.005}}


def run_kind(client, store: str, kind: str) -> dict:
    import adam_dask
    from adam_dask.testing import hard_kill

    t0 = time.perf_counter()
    trainer = adam_dask.Trainer(data=store, client=client, progress=False, **settings(kind))
    killed = None
    try:
        box: dict = {}

        def fit() -> None:
            try:
                box["history"] = trainer.fit(epochs=1)
            except BaseException as exc:  # reported in the line
                box["error"] = exc

        th = threading.Thread(target=fit, daemon=True)
        th.start()
        if kind == "sigkill":
            while th.is_alive() and (
                trainer.server is None or trainer.server.stats()["pushes_applied"] < 4
            ):
                time.sleep(0.1)
            if th.is_alive():
                killed = trainer.server.placement()[0][0]
                hard_kill(client, [killed])
        th.join()
        if "error" in box:
            return {"error": repr(box["error"])}
        nodes = [n for n in trainer.server.stats()["nodes"].values() if isinstance(n, dict)]
        rec = box["history"].records[-1]
    finally:
        trainer.close()
    moved = {k: sum(n["by_transport"][k] for n in nodes) for k in ("plane", "dask")}
    return {
        "by_transport": moved,
        "plane_only": moved["plane"] > 0 and moved["dask"] == 0,
        "images": rec["images"],
        "images_applied": rec["images_applied"],
        "applied_once": rec["images_applied"] == rec["images"],
        "test_accuracy": rec["test_accuracy"],
        "seconds": time.perf_counter() - t0,
        "killed": killed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4096, help="MNIST training images (4096)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated of {KINDS}")
    p.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    import adam_dask

    kinds = [k for k in args.kinds.split(",") if k]
    store = mnist_subset_store(args.images)
    load_before = os.getloadavg()[0]
    out: dict = {"images": args.images, "kinds": {}}
    with adam_dask.cluster.local(trainers=2) as client:
        for kind in kinds:
            out["kinds"][kind] = run_kind(client, store, kind)
            print(kind, out["kinds"][kind], flush=True)
    out["plane_only_every_kind"] = all(k.get("plane_only") for k in out["kinds"].values())
    out["applied_once_every_kind"] = all(k.get("applied_once") for k in out["kinds"].values())
    out["goals"] = {"dask": 0}
    out["load"] = [load_before, os.getloadavg()[0]]
    record("data_path", out, save=not args.no_save)


if __name__ == "__main__":
    main()
