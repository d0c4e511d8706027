"""The system as pods run it: the image tools/build-image builds, the scheduler and the PS, DATA
and TRAIN workers each in a container of their own (deploy/operator/job.yaml's arguments), the
DaskJob's pipelines/train.py in another, and faults sent from outside with podman, at default
settings, mid-epoch: a PS container killed (SIGKILL), a PS, a DATA and a TRAIN container stopped
(SIGTERM, SIGKILL after the grace period: an eviction), each replaced by a new pod as the
operator would, and last the job's own pod stopped and started again, as a Job restarts its pod:
it resumes the run from the checkpoint. What an eviction costs an epoch is measured by benchmarks/evictions.py, not
asserted here (a timing); that no fault stalls an epoch is."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from adam_dask.testing import write_mnist_like

pytestmark = pytest.mark.slow

# MNIST's size: a PS host lost costs a few seconds (heartbeat-timeout, plane-timeout), which the
# 1.3x bound is measured against (the epochs were MNIST's)
N_TRAIN = 60000
N_TEST = 1000
EPOCHS = 9
# (how, role) sent mid-way through epochs 3 to 7; epochs 0-2 (undisturbed) tell how long an
# epoch takes; epoch 7 is also the replacement TRAIN pod's first, and epoch 8 the resumed job's
# first whole one
FAULTS = [("kill", "PS"), ("stop", "PS"), ("stop", "DATA"), ("stop", "TRAIN"), ("stop", "JOB")]
FIRST = 3


def wait_for(predicate, timeout: float, what, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"not within {timeout:.0f}s: {what() if callable(what) else what}")


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


@pytest.fixture(scope="module")
def run(pod_cluster_factory, data) -> dict:
    """The DaskJob's run through the faults: {"sent", "status", "logs", "result", "records",
    "cluster"}; the tests below judge it."""
    cluster = pod_cluster_factory(data)
    cluster.start()
    job_pod = cluster.start_job(epochs=EPOCHS)
    sent: list[dict] = []

    try:
        for epoch, (how, role) in enumerate(FAULTS, start=FIRST):
            # epoch - 1 finished (its record in the checkpoint's history): fault epoch mid-way
            records = wait_for(
                lambda n=epoch: cluster.epochs_done(n),
                timeout=600,
                what=lambda n=epoch, pod=job_pod: (
                    f"epoch {n - 1}'s record; the job's log ends "
                    + cluster.logs(pod, tail=10)[-1500:]
                ),
            )
            # 30% into the epoch: from when its predecessor's record was written
            began = cluster.history_path.stat().st_mtime
            time.sleep(max(0.0, began + 0.3 * records[-1]["seconds"] - time.time()))
            victim = job_pod if role == "JOB" else cluster.workers[role][0]
            t0 = time.monotonic()
            status = cluster.kill(victim) if how == "kill" else cluster.stop(victim)
            gone = round(time.monotonic() - t0, 2)
            # the epoch still under way when the pod was gone
            landed = len(cluster.history()) == epoch
            if role == "JOB":  # it ended as a stopped job does; the Job starts its pod again
                assert status == 143, cluster.logs(job_pod)
                job_pod = cluster.start_job(epochs=EPOCHS, attempt=1)
            else:
                assert cluster.job_alive(job_pod), cluster.logs(job_pod)
                cluster.start_worker(role)  # the operator keeps the group at its replicas
            sent.append(
                {"epoch": epoch, "fault": how, "victim": victim, "exit": status, "gone_s": gone}
            )
            assert landed, f"the {how} of {victim} landed after epoch {epoch} ended: {sent}"
        status = cluster.wait(job_pod, timeout=900)
        logs = cluster.logs(job_pod, tail=-1)
    finally:
        print(json.dumps(sent))  # the pods' logs: logs-0/ beside the checkpoint
        if cluster.ended:  # replaced as the operator would, and worth knowing
            print(f"pods that ended by themselves: {cluster.ended}")
        if any(cluster.jobs.values()):  # started again as the Job's restartPolicy does
            print(f"job pods started again after a failure: {cluster.jobs}")
    assert status == 0, f"the job exited {status}: {logs[-3000:]}"
    # the job's last line on stdout is its JSON result (podman logs interleaves the pod's stderr
    # with it, so it is read from its opening brace)
    result, _ = json.JSONDecoder().raw_decode(logs[logs.rindex('{"data"') :])
    records = cluster.history()
    print(json.dumps(result))
    keys = ("epoch", "seconds", "images", "images_applied", "images_retrained", "replica_workers")
    keys += ("stall_fraction", "ps_fraction")
    print(json.dumps([{k: r[k] for k in keys} for r in records]))
    return {"sent": sent, "result": result, "records": records, "cluster": cluster}


@pytest.mark.timeout(1200)  # the image's build, when it is not there yet, and the whole run
def test_the_job_completes_through_the_faults(run):
    assert [f["epoch"] for f in run["sent"]] == list(range(FIRST, FIRST + len(FAULTS)))
    # the job's second pod resumed the run at the epoch the first was stopped in
    assert run["result"]["resumed"] and run["result"]["epoch"] == EPOCHS - 1, run["result"]
    assert run["result"]["epochs_trained"] == EPOCHS - FAULTS.index(("stop", "JOB")) - FIRST
    assert [r["epoch"] for r in run["records"]] == list(range(EPOCHS))


def test_every_image_applied_once(run):
    assert [r["images_applied"] for r in run["records"]] == [N_TRAIN] * EPOCHS, run["records"]


def test_no_image_retrained(run):
    assert [r["images_retrained"] for r in run["records"]] == [0] * EPOCHS, run["records"]


def test_no_fault_stalls_an_epoch(run):
    """Liveness: an epoch through a fault ends within adam.ps.call-timeout (30 s) of an
    undisturbed one (the median of the epochs before the first fault): a pusher or a stream that
    waited on a lost pod until a timeout fired would cost more. How much less it costs (the
    issue's 1.3x) is a speed, measured by benchmarks/evictions.py and printed here."""
    import dask

    seconds = [r["seconds"] for r in run["records"]]
    undisturbed = sorted(seconds[:FIRST])[FIRST // 2]
    ratios = [round(t / undisturbed, 2) for t in seconds]
    print(f"epoch seconds {seconds}, against the undisturbed median {ratios}")
    bound = undisturbed + float(dask.config.get("adam.ps.call-timeout"))
    stalled = [i for i in range(FIRST, len(seconds)) if seconds[i] > bound]
    assert not stalled, f"epochs {stalled} over {bound:.1f} s: {seconds}"
