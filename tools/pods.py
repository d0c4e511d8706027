"""The DaskJob's pods as podman containers (tests/containers and benchmarks/evictions.py
--containers): the image ``tools/build-image`` builds, and a cluster of containers started the
way ``deploy/operator/job.yaml`` starts its pods.

Every pod is a container of its own on a podman network (its own network namespace and hostname;
names resolve through the network's DNS, as a Kubernetes service does), running the image with
the arguments the manifest gives it: the scheduler with its preloads, the PS, DATA and TRAIN
worker groups (``dask worker ... --resources PS=1``, ``$(DASK_WORKER_NAME)`` filled in as
Kubernetes fills it in), and the DaskJob's pod running ``pipelines/train.py`` through its own
``/bin/sh -c`` command. ``DASK_SCHEDULER_ADDRESS`` is set in every pod as the operator sets it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import yaml

from adam_dask.train.run_state import HISTORY

ROOT = Path(__file__).resolve().parents[1]
JOB_YAML = ROOT / "deploy" / "operator" / "job.yaml"
logger = logging.getLogger(__name__)
BACKOFF_LIMIT = 6  # a Job's pod failures before it is failed (Kubernetes' default backoffLimit)


def _one_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"


class ImageError(RuntimeError):
    """tools/build-image failed or is missing what it needs: the one line it gave."""


def build_image() -> dict:
    """Build the image with ``tools/build-image`` (kept when present) and return
    ``{"image": tag, "env": environment for podman, "log": the script's output}``;
    :class:`ImageError` with the one line the script gave where it failed."""
    if shutil.which("bash") is None:
        raise ImageError("tools/build-image needs bash")
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "build-image"), "--no-smoke"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise ImageError(
            f"tools/build-image failed ({proc.returncode}): {_one_line(proc.stderr or proc.stdout)}"
        )
    conf = proc.stdout.strip().splitlines()[-1]
    if not conf.startswith("CONTAINERS_CONF="):
        raise ImageError(f"tools/build-image printed no CONTAINERS_CONF: {_one_line(proc.stdout)}")
    env = dict(os.environ, CONTAINERS_CONF=conf.split("=", 1)[1])
    version = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if version is None:
        raise ImageError("pyproject.toml names no version")
    return {"image": f"adam-dask:{version.group(1)}", "env": env, "log": proc.stdout.strip()}


def operator_pods() -> dict:
    """What deploy/operator/job.yaml runs: {"scheduler": args, "groups": {role: (replicas,
    args)}, "job": (command, args, env), "cluster": name}."""
    docs = [d for d in yaml.safe_load_all(JOB_YAML.read_text()) if d]
    (job,) = [d for d in docs if d["kind"] == "DaskJob"]
    cluster = job["metadata"]["name"]
    spec = job["spec"]["cluster"]["spec"]
    (sched,) = spec["scheduler"]["spec"]["containers"]
    groups: dict[str, tuple[int, list[str]]] = {}

    def role_of(args: list[str]) -> str:
        res = args[args.index("--resources") + 1]
        return res.split("=")[0]

    (default,) = spec["worker"]["spec"]["containers"]
    groups[role_of(default["args"])] = (spec["worker"]["replicas"], list(default["args"]))
    for d in docs:
        if d["kind"] == "DaskWorkerGroup":
            assert d["spec"]["cluster"] == cluster
            (c,) = d["spec"]["worker"]["spec"]["containers"]
            groups[role_of(c["args"])] = (d["spec"]["worker"]["replicas"], list(c["args"]))
    (jc,) = job["spec"]["job"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in jc.get("env", [])}
    return {
        "cluster": cluster,
        "scheduler": list(sched["args"]),
        "groups": groups,
        "job": (list(jc["command"]), list(jc["args"]), env),
    }


class PodCluster:
    """The DaskJob's pods as podman containers on a network of their own.

    ``data`` is mounted read-only at /data and ``checkpoint`` read-write at /ckpt in every pod;
    ``checkpoint_on_scheduler=False`` starts the scheduler without the checkpoint's folder (a
    hook for the case where the scheduler can not reach the checkpoint's storage).
    """

    def __init__(
        self,
        image: str,
        env: dict,
        data: Path,
        checkpoint: Path,
        *,
        checkpoint_on_scheduler: bool = True,
    ):
        self.image = image
        self.env = env
        self.data = data
        self.checkpoint = checkpoint
        self.checkpoint_on_scheduler = checkpoint_on_scheduler
        self.pods = operator_pods()
        self.name = self.pods["cluster"]
        self.prefix = f"adam-test-{uuid.uuid4().hex[:8]}"
        self.network = self.prefix
        self.scheduler_address = f"tcp://{self.name}-scheduler:8786"
        self.containers: dict[str, str] = {}  # pod name -> container name, every one started
        self.counts: dict[str, int] = {}
        self.workers: dict[str, list[str]] = {}  # role -> live pod names
        self.ended: list[str] = []  # worker pods that ended by themselves, replaced
        self.jobs: dict[str, int] = {}  # job pod -> times it was started again in place
        self.evicted: set[str] = set()  # pods ended by kill or stop (never started again)
        self._kept = 0.0  # when the operator's loop last ran (epochs_done)

    # -- podman ---------------------------------------------------------------------------------
    def podman(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        proc = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args[:2])}: {_one_line(proc.stderr)}")
        return proc.stdout

    def _run(
        self,
        pod: str,
        args: list[str],
        *,
        entrypoint: list[str] | None = None,
        env: dict | None = None,
        checkpoint: bool = True,
        alias: str | None = None,
    ) -> str:
        container = f"{self.prefix}-{pod}"
        cmd = ["run", "--detach", "--pull", "never", "--name", container, "--hostname", pod]
        cmd += ["--network", self.network]
        if alias:
            cmd += ["--network-alias", alias]
        cmd += ["--volume", f"{self.data}:/data:ro"]
        if checkpoint:
            cmd += ["--volume", f"{self.checkpoint}:/ckpt"]
        for k, v in {"DASK_SCHEDULER_ADDRESS": self.scheduler_address, **(env or {})}.items():
            cmd += ["--env", f"{k}={v}"]
        if entrypoint is not None:
            cmd += ["--entrypoint", json.dumps(entrypoint)]
        self.podman(*cmd, self.image, *args)
        self.containers[pod] = container
        return container

    # -- the pods -------------------------------------------------------------------------------
    def start(self) -> None:
        self.podman("network", "create", self.network)
        self._run(
            f"{self.name}-scheduler",
            self.pods["scheduler"],
            checkpoint=self.checkpoint_on_scheduler,
            alias=f"{self.name}-scheduler",
        )
        for role, (replicas, _) in self.pods["groups"].items():
            for _ in range(replicas):
                self.start_worker(role)

    def start_worker(self, role: str) -> str:
        """A new pod of ``role``'s group (a replacement too: the operator keeps the replicas)."""
        n = self.counts.get(role, 0)
        self.counts[role] = n + 1
        pod = f"{self.name}-{role.lower()}-{n}"
        # Kubernetes expands $(VAR) in args from the pod's environment
        args = [a.replace("$(DASK_WORKER_NAME)", pod) for a in self.pods["groups"][role][1]]
        self._run(pod, args, env={"DASK_WORKER_NAME": pod})
        self.workers.setdefault(role, []).append(pod)
        return pod

    def start_job(self, epochs: int, attempt: int = 0) -> str:
        """The DaskJob's pod (``attempt`` > 0: the pod the Job starts again after one ended, a
        pod of a new name); returns the pod's name."""
        command, args, env = self.pods["job"]
        (script,) = args
        script, n = re.subn(r"--epochs \d+", f"--epochs {epochs}", script)
        assert n == 1, script
        env = dict(env, ADAM_DATA="/data/store.zarr", ADAM_CHECKPOINT="/ckpt/run")
        pod = f"{self.name}-job" + (f"-{attempt}" if attempt else "")
        self._run(pod, [script], entrypoint=command, env=env)
        self.jobs[pod] = 0
        return pod

    def job_alive(self, pod: str) -> bool:
        """Whether the job's pod runs, after the Job's ``restartPolicy: OnFailure``
        (deploy/operator/job.yaml) had its say: a job pod that exited non-zero by itself (not
        by :meth:`kill` or :meth:`stop`) starts again in place, as the kubelet restarts its
        container, up to Kubernetes' default backoff limit (6); it resumes from its checkpoint.
        Seen here (CI, 2026-11-27): a resumed job pod's new connection to the scheduler timed
        out (30 s) while the scheduler served its others, and the run ended with exit 2."""
        if self.running(pod):
            return True
        if pod in self.evicted or self.jobs.get(pod, BACKOFF_LIMIT) >= BACKOFF_LIMIT:
            return False
        status = self.podman("inspect", "--format", "{{.State.ExitCode}}", self.containers[pod])
        if int(status) == 0:
            return False
        self.jobs[pod] += 1
        logger.warning(
            "job pod %s exited %s; started again: %s", pod, status.strip(), self.logs(pod, 5)
        )
        self.podman("start", self.containers[pod])
        return True

    def kill(self, pod: str) -> None:
        """SIGKILL the pod's every process (``podman kill``: a machine lost)."""
        self.podman("kill", self.containers[pod])
        self._gone(pod)

    def stop(self, pod: str, grace: int = 30) -> int:
        """SIGTERM, then SIGKILL after ``grace`` seconds (``podman stop``, as Kubernetes evicts a
        pod with its default grace period); returns the pod's exit status."""
        self.podman("stop", "--time", str(grace), self.containers[pod], timeout=grace + 60)
        self._gone(pod)
        return int(self.podman("inspect", "--format", "{{.State.ExitCode}}", self.containers[pod]))

    def _gone(self, pod: str) -> None:
        self.evicted.add(pod)
        for pods in self.workers.values():
            if pod in pods:
                pods.remove(pod)

    @property
    def history_path(self) -> Path:
        """The run's history in the checkpoint (a record appended as each epoch ends)."""
        return self.checkpoint / "run" / HISTORY

    def history(self) -> list[dict]:
        """The run's epoch records so far."""
        try:
            text = self.history_path.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def epochs_done(self, epochs: int) -> list[dict] | None:
        """The history once it holds ``epochs`` epochs, else None; the operator's loop
        (:meth:`keep_replicas`) runs meanwhile, every 5 s: its podman calls take seconds on a
        busy machine, and the history is read between them so a fault is sent as soon as its
        epoch begins (CI: 20 s lost there put a fault past its epoch's end)."""
        records = self.history()
        if len(records) >= epochs:
            return records
        if time.monotonic() - self._kept > 5:
            self.keep_replicas()
            self._kept = time.monotonic()
        return None

    def keep_replicas(self) -> list[str]:
        """The operator's loop, once: a worker pod that ended by itself (not by :meth:`kill` or
        :meth:`stop`) is replaced by a new one of its group; returns the pods that ended."""
        ended = []
        for role, pods in self.workers.items():
            for pod in list(pods):
                if not self.running(pod):
                    logger.warning("pod %s ended by itself: %s", pod, self.logs(pod, tail=5))
                    pods.remove(pod)
                    self.start_worker(role)
                    ended.append(pod)
        self.ended += ended
        return ended

    def wait(self, pod: str, timeout: float) -> int:
        """The pod's exit status once it ends, the worker groups kept at their replicas
        meanwhile."""
        deadline = time.monotonic() + timeout
        while self.job_alive(pod) if pod in self.jobs else self.running(pod):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pod} still running after {timeout:.0f}s")
            self.keep_replicas()
            time.sleep(1)
        out = self.podman("inspect", "--format", "{{.State.ExitCode}}", self.containers[pod])
        return int(out)

    def running(self, pod: str) -> bool:
        out = self.podman("inspect", "--format", "{{.State.Running}}", self.containers[pod])
        return out.strip() == "true"

    def logs(self, pod: str, tail: int = 40) -> str:
        proc = subprocess.run(
            ["podman", "logs", "--tail", str(tail), self.containers[pod]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return proc.stdout + proc.stderr

    def save_logs(self, folder: Path) -> None:
        """Every pod's whole log (stdout and stderr) in ``folder/<pod>.log``."""
        folder.mkdir(parents=True, exist_ok=True)
        for pod in self.containers:
            (folder / f"{pod}.log").write_text(self.logs(pod, tail=-1))

    def close(self) -> None:
        for container in self.containers.values():
            self.podman("rm", "--force", "--time", "0", container, check=False)
        self.podman("network", "rm", "--force", self.network, check=False)
