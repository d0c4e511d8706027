"""``benchmarks/evictions.py --containers``: the evictions on the DaskJob's pods (issue 48).

The cluster is ``tools/pods.py``'s :class:`PodCluster`: the image ``tools/build-image`` builds,
the scheduler and every worker in a podman container of its own as deploy/operator/job.yaml
starts them, and the DaskJob's pod running ``pipelines/train.py`` on real MNIST (ingested here,
mounted read-only in every pod) with its checkpoint. The undisturbed epochs come first
(``--epoch`` of them); then each role of ``--roles`` is evicted in an epoch of its own, ``--gap``
undisturbed epochs apart (so that an epoch carries its own eviction, not the settling of the
one before: the replacement pod's start and its first batches), ``--at`` into it (timed from the previous epoch's record in the checkpoint's history): ``podman stop``
(SIGTERM, SIGKILL after the 30 s grace period, as Kubernetes evicts a pod), and once the pod is
gone a replacement pod of its group starts, as the operator starts one. One epoch more ends the
run. One line per role, as the processes' mode writes, with ``cluster: "containers"``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _mnist_folder(folder: Path, url: str) -> None:
    """The MNIST store at ``url`` copied into ``folder/store.zarr``, readable by the image's
    user (uid 1000)."""
    import shutil

    shutil.copytree(url, folder / "store.zarr")
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    folder.chmod(0o755)


def _train_images(url: str) -> int:
    from adam_dask.data.datasets import open_split

    return len(open_split(url, "train"))


def run(url: str, roles: list[str], args: Any) -> list[dict]:
    """Evict each of ``roles`` in turn from one DaskJob's run; one record per role."""
    sys.path.insert(0, str(ROOT / "tools"))
    from pods import PodCluster, build_image

    first, step = args.epoch, 1 + max(0, args.gap)
    at = [first + i * step for i in range(len(roles))]  # the epoch each role is evicted in
    epochs = at[-1] + 2
    built = build_image()
    sent: list[dict] = []
    error = None
    with tempfile.TemporaryDirectory(prefix="adam-pod-evict-") as tmp:
        data, ckpt = Path(tmp) / "data", Path(tmp) / "ckpt"
        data.mkdir()
        ckpt.mkdir()
        ckpt.chmod(0o777)  # the image runs as uid 1000
        _mnist_folder(data, url)
        cluster = PodCluster(built["image"], built["env"], data, ckpt)
        try:
            cluster.start()
            job = cluster.start_job(epochs=epochs)
            for epoch, role in zip(at, roles):
                deadline = time.monotonic() + 900
                while (records := cluster.epochs_done(epoch)) is None:
                    if time.monotonic() > deadline or not cluster.job_alive(job):
                        raise RuntimeError(
                            f"epoch {epoch - 1} never ended: {cluster.logs(job, tail=10)[-800:]}"
                        )
                    time.sleep(0.2)
                began = cluster.history_path.stat().st_mtime
                time.sleep(max(0.0, began + args.at * records[-1]["seconds"] - time.time()))
                victim = cluster.workers[role][0]
                t0 = time.monotonic()
                status = cluster.stop(victim)
                gone = time.monotonic() - t0
                cluster.start_worker(role)
                sent.append(
                    {
                        "role": role,
                        "epoch": epoch,
                        "exit": status,
                        "gone_seconds": gone,
                        "landed": len(cluster.history()) == epoch,
                    }
                )
            status = cluster.wait(job, timeout=900)
            if status != 0:
                error = f"the job exited {status}: {cluster.logs(job, tail=20)[-1500:]}"
        except Exception as exc:  # the line says what went wrong
            error = repr(exc)
        finally:
            records = cluster.history()
            if error:
                cluster.save_logs(Path(tempfile.mkdtemp(prefix="adam-pod-evict-logs-")))
            cluster.close()
    seconds = [r["seconds"] for r in records]
    before = seconds[1:first] or seconds[:first]
    undisturbed = statistics.median(before) if before else None

    def ratio(i: int) -> float | None:
        return seconds[i] / undisturbed if undisturbed and i < len(seconds) else None

    applied = [r["images_applied"] for r in records]
    images = [r["images"] for r in records]
    # an evicted TRAIN pod's replica returns no result (its images are not in the epoch's
    # "images"), but its acknowledged pushes are applied: every image once is the whole split
    # applied in every epoch, none re-trained
    n = _train_images(url)
    base = {
        "cluster": "containers",
        "signal": "SIGTERM",
        "at": args.at,
        "gap": max(0, args.gap),
        "epochs": epochs,
        "completed": error is None and len(records) == epochs,
        "error": error,
        "epoch_seconds": seconds,
        "undisturbed_seconds": undisturbed,
        "replicas": [r["replicas"] for r in records],
        "images": images,
        "images_applied": applied,
        "images_retrained": [r["images_retrained"] for r in records],
        "train_images": n,
        "every_image_once": bool(records) and all(a == n for a in applied),
        "test_accuracy": [r.get("test_accuracy") for r in records],
        # where an evicted epoch's time went: the replicas waiting for images (DATA), or not
        "stall_fraction": [r.get("stall_fraction") for r in records],
    }
    out = []
    for i, role in enumerate(roles):
        fault = sent[i] if i < len(sent) else {}
        epoch = at[i]
        out.append(
            {
                "role": role,
                "fault_epoch": epoch,
                "ratio": ratio(epoch),
                "next_ratio": ratio(epoch + 1),
                "gone_seconds": fault.get("gone_seconds"),
                "exit": fault.get("exit"),
                "landed_mid_epoch": fault.get("landed"),
                **base,
            }
        )
    return out
