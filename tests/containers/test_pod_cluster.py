"""The system as pods run it: the image tools/build-image builds, the scheduler and the PS, DATA
and TRAIN workers each in a container of their own (deploy/operator/job.yaml's arguments), the
DaskJob's pipelines/train.py in another, and faults sent from outside with podman, at default
settings, mid-epoch: a PS container killed (SIGKILL), a TRAIN and a PS container stopped
(SIGTERM, SIGKILL after the grace period), each replaced by a new pod as the operator would."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from adam_dask.testing import write_mnist_like
from adam_dask.train._checkpoint import HISTORY

N_TRAIN = 40000  # a few seconds an epoch once the workers' kernels are compiled
N_TEST = 1000
EPOCHS = 5
# (how, role) sent mid-way through epochs 2, 3 and 4; epoch 0 compiles the kernels, and epoch 1
# (undisturbed) tells how long an epoch takes
FAULTS = [("kill", "PS"), ("stop", "TRAIN"), ("stop", "PS")]
FIRST = 2


def wait_for(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


@pytest.fixture(scope="module")
def data(podman_image, tmp_path_factory) -> Path:
    """A small synthetic MNIST-like dataset, ingested in a container with no network."""
    import subprocess

    folder = tmp_path_factory.mktemp("pod-data")
    folder.chmod(0o777)  # the image runs as uid 1000
    write_mnist_like(folder / "src", n_train=N_TRAIN, n_test=N_TEST)
    proc = subprocess.run(
        ["podman", "run", "--rm", "--pull", "never", "--network", "none"]
        + ["--volume", f"{folder}:/data", podman_image["image"]]
        + ["adam-dask", "ingest", "/data/src", "/data/store.zarr"],
        env=podman_image["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["splits"]["train"]["images"] == N_TRAIN
    return folder


def history(cluster) -> list[dict]:
    path = cluster.checkpoint / "run" / HISTORY
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.timeout(1200)
def test_job_through_pod_kills_and_evictions(pod_cluster_factory, data):
    cluster = pod_cluster_factory(data)
    cluster.start()
    job = cluster.start_job(epochs=EPOCHS)
    job_pod = f"{cluster.name}-job"
    sent = []
    try:
        for epoch, (how, role) in enumerate(FAULTS, start=FIRST):
            # epoch - 1 finished (its record in the checkpoint's history): fault epoch mid-way
            records = wait_for(
                lambda n=epoch: len(h := history(cluster)) >= n and h,
                timeout=600,
                what=f"epoch {epoch - 1}'s record",
            )
            assert cluster.running(job_pod), cluster.logs(job_pod)
            time.sleep(0.3 * records[-1]["seconds"])
            victim = cluster.workers[role][0]
            t0 = time.monotonic()
            status = cluster.kill(victim) if how == "kill" else cluster.stop(victim)
            gone = time.monotonic() - t0
            landed = len(history(cluster)) == epoch  # epoch still under way when it was gone
            cluster.start_worker(role)  # the operator keeps the group at its replicas
            sent.append(
                {"epoch": epoch, "fault": how, "victim": victim, "exit": status, "gone_s": gone}
            )
            assert landed, f"the {how} of {victim} landed after epoch {epoch} ended: {sent}"
        status = cluster.wait(job_pod, timeout=900)
        logs = cluster.logs(job_pod, tail=-1)
        assert status == 0, f"the job exited {status}: {logs}"
    finally:
        print(json.dumps(sent))  # the pods' logs: logs-0/ beside the checkpoint
    # the job's last line on stdout is its JSON result (podman logs interleaves the pod's stderr
    # with it, so it is read from its opening brace)
    result, _ = json.JSONDecoder().raw_decode(logs[logs.rindex('{"data"') :])
    records = history(cluster)
    print(json.dumps(result))
    keys = ("epoch", "seconds", "images", "images_applied", "images_retrained", "test_accuracy")
    print(json.dumps([{k: r[k] for k in keys} for r in records]))
    assert result["epochs_trained"] == EPOCHS and job == cluster.containers[job_pod]
    assert [r["epoch"] for r in records] == list(range(EPOCHS))
    # every image applied once, none trained twice
    assert [r["images_applied"] for r in records] == [N_TRAIN] * EPOCHS, records
    assert [r["images_retrained"] for r in records] == [0] * EPOCHS, records
    # no epoch over 1.3x the one before it
    seconds = [r["seconds"] for r in records]
    for prev, cur in zip(seconds, seconds[1:]):
        assert cur <= 1.3 * prev, seconds
