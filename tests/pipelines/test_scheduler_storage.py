"""The scheduler writes the checkpoint's manifest: a scheduler that can not reach the checkpoint's
storage must never stall a job (issue 38).

A cluster started the way pods start it (deploy/operator/cluster.yaml's arguments: ``dask
scheduler`` with the preloads, ``dask worker`` processes with their role as a resource, the
scheduler's address from ``DASK_SCHEDULER_ADDRESS``), the scheduler in a mount namespace of its
own, where a tmpfs mounted over a folder hides the checkpoint from it alone, as a container
without the volume would; the workers and the job (``pipelines/train.py``) reach it.

* Not reachable at all: the job refuses at start, in one line naming what the scheduler can not
  reach, before any epoch.
* Reachable at start, then gone: training goes on, the job says so once while it trains, the
  scheduler logs it once (not once per retry), and when storage is back the checkpoint catches
  up with the last epoch.

Needs root (``unshare``, ``nsenter``, ``mount``); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from adam_dask.ps.checkpoint import read_manifest
from adam_dask.testing import synthetic_store

ROOT = Path(__file__).parents[2]
PIPELINE = str(ROOT / "pipelines" / "train.py")
CLUSTER_YAML = ROOT / "deploy" / "operator" / "cluster.yaml"
SPEC = "conv5x5:6,maxpool2,fc32,fc10"
EPOCHS = 8


def _mount_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a mount namespace for the scheduler)"
    for tool in ("unshare", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        return "unshare --mount is not allowed here"
    return None


pytestmark = pytest.mark.skipif(_mount_problem() is not None, reason=str(_mount_problem()))


def _pod_args() -> dict[str, list[str]]:
    """{"scheduler" | role: the container's args} from deploy/operator/cluster.yaml."""
    docs = list(yaml.safe_load_all(CLUSTER_YAML.read_text()))
    out = {"scheduler": docs[0]["spec"]["scheduler"]["spec"]["containers"][0]["args"]}
    for spec in [docs[0]["spec"]["worker"]] + [d["spec"]["worker"] for d in docs[1:]]:
        args = spec["spec"]["containers"][0]["args"]
        out[args[args.index("--resources") + 1].split("=")[0]] = args
    return out


def _here(args: list[str], **replace: str) -> list[str]:
    """A container's ``dask ...`` args as this machine runs them: this interpreter, and the
    values that differ between machines (ports, names) replaced."""
    cli = {"scheduler": "distributed.cli.dask_scheduler", "worker": "distributed.cli.dask_worker"}
    assert args[0] == "dask", args
    argv = [sys.executable, "-m", cli[args[1]]]
    rest = list(args[2:])
    for i, a in enumerate(rest):
        if a in replace:
            rest[i] = replace[a]
    return argv + rest


class PodCluster:
    """The scheduler (in its own mount namespace) and one PS, one DATA and one TRAIN worker."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: list[subprocess.Popen] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{port}"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", DASK_SCHEDULER_ADDRESS=self.address)
        pods = _pod_args()
        sched = _here(pods["scheduler"]) + ["--host", "127.0.0.1", "--port", str(port)]
        sched += ["--dashboard-address", "127.0.0.1:0"]
        # unshare execs the scheduler: its pid is the scheduler's, whose namespace nsenter enters
        self.scheduler = self._popen(
            "scheduler", ["unshare", "--mount", "--propagation", "private", *sched]
        )
        self.procs.append(self.scheduler)
        for role in ("PS", "DATA", "TRAIN"):
            name = f"{role.lower()}-0"
            argv = _here(pods[role], **{"$(DASK_WORKER_NAME)": name, "8788": "127.0.0.1:0"})
            self.procs.append(self._popen(name, argv))
        from distributed import Client

        with Client(self.address, timeout=60) as client:
            client.wait_for_workers(3, timeout=120)

    def _popen(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.folder / f"{name}.log", "wb") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def hide(self, path: Path) -> None:
        """``path`` (a folder) shows empty to the scheduler alone from now on."""
        self._nsenter("mount", "-t", "tmpfs", "-o", "size=1m", "adam-hidden", str(path))

    def show(self, path: Path) -> None:
        self._nsenter("umount", str(path))

    def _nsenter(self, *argv: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.scheduler.pid), "-m", *argv], check=True)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # epochs of a second or two here: an outage begun after the first one lands mid-training
    return synthetic_store(tmp_path_factory.mktemp("sched-data"), n_train=12000, n_test=256)


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    cluster = PodCluster(tmp_path_factory.mktemp("sched-pods"))
    try:
        yield cluster
    finally:
        cluster.close()


def _job(pods: PodCluster, store: str, ckpt: Path, metrics: Path) -> subprocess.Popen:
    """pipelines/train.py as deploy/operator/job.yaml runs it, its output in files."""
    argv = [sys.executable, PIPELINE, "--scheduler", pods.address, "--data", store]
    argv += ["--checkpoint", str(ckpt), "--model", SPEC, "--epochs", str(EPOCHS)]
    argv += ["--metrics-out", str(metrics)]
    out, err = open(metrics.parent / "job.out", "w"), open(metrics.parent / "job.err", "w")
    with out, err:
        return subprocess.Popen(argv, stdout=out, stderr=err, text=True, start_new_session=True)


def _epochs(metrics: Path) -> int:
    return metrics.read_text().count("\n") if metrics.exists() else 0


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_scheduler_without_the_checkpoint_refuses_the_job_at_start(pods, store, tmp_path):
    """The checkpoint's folder is not there for the scheduler at all (a container without the
    volume): the job ends at start, in one line naming what the scheduler can not reach, and
    trains nothing. Before: it trained, the scheduler logged a retry every few seconds, and
    the job waited for the manifest (``adam.ps.flush-timeout``) at the end, saying nothing."""
    volume = tmp_path / "volume"
    volume.mkdir()
    ckpt, metrics = volume / "ck", tmp_path / "m.jsonl"
    pods.hide(volume)
    try:
        job = _job(pods, store, ckpt, metrics)
        try:
            job.wait(timeout=150)  # the stall kept it far longer (flush-timeout: 300 s)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the job stalled: {_epochs(metrics)} epochs, then nothing; its log: "
                + (tmp_path / "job.err").read_text()[-2000:]
            )
        finally:
            _stop(job)
    finally:
        pods.show(volume)
    err = (tmp_path / "job.err").read_text()
    lines = [line for line in err.splitlines() if line.strip()]
    assert job.returncode == 2, err[-3000:]
    assert "Traceback" not in err and (tmp_path / "job.out").read_text() == "", err[-3000:]
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]], err[-3000:]
    assert lines[-1].startswith(f"error: the scheduler can not reach the checkpoint at {ckpt} ")
    assert "manifest.json" in lines[-1], lines[-1]
    assert _epochs(metrics) == 0, metrics.read_text()
    refusals = [line for line in pods.log("scheduler").splitlines() if " refused: " in line]
    assert len(refusals) == 1 and str(ckpt) in refusals[0], refusals


def test_a_manifest_outage_never_stalls_training_and_is_said_once(pods, store, tmp_path):
    """The scheduler loses the checkpoint's folder after the first epoch (its storage fails, the
    workers' works): every epoch is trained while it is gone, the job says so once while it
    still trains, the scheduler logs the failing manifest once (not once per retry), and when
    the folder is back the checkpoint catches up with the last epoch and the job ends well."""
    volume = tmp_path / "volume"
    volume.mkdir()
    ckpt, metrics = volume / "ck", tmp_path / "m.jsonl"
    job = _job(pods, store, ckpt, metrics)
    hidden = False
    said_at = None  # epochs trained when the job first said storage is out
    try:
        while _epochs(metrics) < 1:
            assert job.poll() is None, (tmp_path / "job.err").read_text()[-3000:]
            time.sleep(0.05)
        pods.hide(volume)
        hidden = True
        deadline = time.monotonic() + 150  # a bound on the test, no figure it checks
        while said_at is None or _epochs(metrics) < EPOCHS:
            trained = _epochs(metrics)  # read before the log: said while these were done
            if said_at is None and "training goes on" in (tmp_path / "job.err").read_text():
                said_at = trained
            assert job.poll() is None, (tmp_path / "job.err").read_text()[-3000:]
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{trained} of {EPOCHS} epochs; the job said "
                    + ("nothing of the outage" if said_at is None else f"it after {said_at}")
                    + ": "
                    + (tmp_path / "job.err").read_text()[-2000:]
                )
            time.sleep(0.05)
        pods.show(volume)  # storage answers again
        hidden = False
        job.wait(timeout=120)
    finally:
        _stop(job)
        if hidden:
            pods.show(volume)
    err = (tmp_path / "job.err").read_text()
    assert job.returncode == 0, err[-3000:]
    result = json.loads((tmp_path / "job.out").read_text().strip().splitlines()[-1])
    assert result["epochs_trained"] == EPOCHS and result["epoch"] == EPOCHS - 1, result
    # trained on while the scheduler could not write: it said so before the last epoch
    assert said_at is not None and said_at < EPOCHS, (said_at, err[-3000:])
    assert err.count("training goes on") == 1, err[-3000:]
    assert err.count("answers again") == 1, err[-3000:]
    assert read_manifest(str(ckpt))["epoch"] == EPOCHS - 1
    sched = pods.log("scheduler")
    failed = [line for line in sched.splitlines() if "writing the manifest failed" in line]
    assert len(failed) == 1, failed[:5] + [f"... {len(failed)} lines in all"]
    assert sched.count("the manifest is written again") == 1, sched[-3000:]
