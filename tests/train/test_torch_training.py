"""A user's own PyTorch module through the whole system: the command line with
``--model package.module:factory``, the embedded cluster's replicas and replicated parameter
server, checkpoints read back into the module, and a TRAIN worker SIGKILLed mid-epoch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import dask
import numpy as np
import pytest

import adam_dask
from adam_dask.cli import run
from adam_dask.cluster import TRAIN, workers_with_role
from adam_dask.ps.checkpoint import read_checkpoint
from adam_dask.testing import (
    fit_in_background,
    hard_kill,
    join_fit,
    synthetic_store,
    wait_role_workers,
)
from adam_dask.train.trainer import Trainer

# the user's package: a module with padding, a strided convolution and a residual block
USER_MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1)
            self.bn = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return torch.relu(x + self.conv2(torch.relu(self.bn(self.conv1(x)))))


    class Net(nn.Module):
        def __init__(self, width=8):
            super().__init__()
            self.stem = nn.Conv2d(1, width, 3, padding=1)
            self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
            self.block = Block(2 * width)
            self.head = nn.Linear(2 * width, 10)

        def forward(self, x):
            x = self.block(torch.relu(self.down(torch.relu(self.stem(x)))))
            return self.head(x.mean(dim=(2, 3)))


    def net():
        return Net()


    def wider():
        return Net(width=12)
    """
)


@pytest.fixture(scope="module", autouse=True)
def torch():
    """torch, imported when these tests run, not when the suite is collected; a test
    dependency, so a missing torch fails these tests instead of skipping the engine."""
    import torch

    return torch


@pytest.fixture(scope="module")
def user_pkg(tmp_path_factory):
    """A folder holding the user's ``byom_models.py``, on ``sys.path`` (the embedded cluster's
    spawned workers inherit it) and on PYTHONPATH (for a console script)."""
    folder = tmp_path_factory.mktemp("user-pkg")
    (folder / "byom_models.py").write_text(USER_MODELS)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("byom_models", None)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("torch-data"), n_train=1024, n_test=256)


@pytest.fixture(scope="module")
def cluster(user_pkg):
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=2, trainer_threads=1, memory_limit="2 GiB"
    ) as client:
        yield client


# 2 async replicas of one thread, momentum 0: each steps the full rate (adam.train.lr-streams),
# so 0.5 each (1.0, the rate these flags gave when a replica stepped lr / R, ended one run at
# chance since)
TRAIN_FLAGS = ["--lr", "0.5", "--push-every", "64", "--no-progress"]


def test_a_user_module_trains_from_the_command_line_and_loads_back(torch, store, cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    printed: list[str] = []
    argv = ["train", "--data", store, "--model", "byom_models:net", "--epochs", "3"]
    argv += [*TRAIN_FLAGS, "--checkpoint", ckpt, "--scheduler", cluster.scheduler.address]
    with dask.config.set({"adam.train.lr-floor": 0.1}):  # the rate falls 10x over the run
        assert run(argv, out=printed.append) == 0
    result = json.loads(printed[-1])
    assert result["test_accuracy"] >= 0.8, result  # chance is 0.1
    # the checkpoint names the factory (no pickle) and evaluates on the command line
    manifest, values = read_checkpoint(ckpt)
    assert manifest["meta"]["model"]["factory"] == "byom_models:net"
    assert "module_pickle" not in manifest["meta"]["model"]
    printed.clear()
    assert run(["evaluate", ckpt, "--data", store], out=printed.append) == 0
    assert json.loads(printed[-1])["test_accuracy"] == pytest.approx(
        result["test_accuracy"],
        abs=0.02,  # batch norm recalibrated on the same images
    )
    # the checkpoint loads into the module, whose weights export as a plain state_dict
    from adam_dask.model.torch_engine import TorchNetwork

    net = TorchNetwork.from_checkpoint(ckpt)
    np.testing.assert_array_equal(net.flat, values)
    from byom_models import Net

    plain = Net()
    plain.load_state_dict(net.state_dict())  # the running statistics as built: calibrate both
    x, _ = adam_dask.data.datasets.open_split(store, "train").read(0, 256)
    net.calibrate(x)
    plain.load_state_dict(net.state_dict())
    plain.eval()
    with torch.no_grad():
        logits = plain(torch.from_numpy(net.as_images(x[:64]))).numpy()
    np.testing.assert_allclose(logits, net.forward(net.as_images(x[:64])), rtol=1e-4, atol=1e-4)


def test_a_torch_run_resumes_and_a_module_not_matching_it_is_one_error(
    store, cluster, tmp_path, capsys
):
    ckpt = str(tmp_path / "ckpt")
    where = ["--checkpoint", ckpt, "--scheduler", cluster.scheduler.address]
    argv = ["train", "--data", store, "--model", "byom_models:net", "--epochs", "1"]
    assert run([*argv, *TRAIN_FLAGS, *where], out=lambda s: None) == 0
    # the manifest's factory path rebuilds the module: the run goes on from its weights
    printed: list[str] = []
    argv = ["train", "--data", store, "--resume", "--epochs", "2", "--no-progress", *where]
    assert run(argv, out=printed.append) == 0
    assert json.loads(printed[-1])["epochs"] == 1 and json.loads(printed[-1])["epoch"] == 1
    capsys.readouterr()
    status = run(["evaluate", ckpt, "--data", store, "--model", "byom_models:wider"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "do not match the checkpoint's layout" in lines[0] and "'stem.weight'" in lines[0]


def test_a_factory_that_cannot_be_imported_is_one_error_line(store, user_pkg):
    proc = subprocess.run(
        [sys.executable, "-m", "adam_dask.cli", "train", "--data", store, "--model", "nope.x:f"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: cannot import 'nope.x'"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_loss_for_a_numba_network_is_refused(torch, store):
    from adam_dask.errors import ConfigError

    with pytest.raises(ConfigError, match="loss= needs a PyTorch model"):
        Trainer(store, model="conv5x5:6,maxpool2,fc10", loss=torch.nn.functional.nll_loss)


def _wait_for_images(trainer, n, box, timeout=300):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if "error" in box or "history" in box:
            raise AssertionError(f"fit ended before {n} images: {box}")
        if sum(trainer._progress_state.values()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"never reached {n} images in {timeout}s: {trainer._progress_state}")


def _module_trainer(torch, store, cluster, **kwargs):
    """A Trainer of the user's ``Net`` as a module object (the replica jobs carry it), 2
    replicas at lr 0.1 with momentum, every replica's share applied (images_applied is the
    split)."""
    from byom_models import Net

    torch.manual_seed(0)
    return Trainer(
        store,
        model=Net(),
        client=cluster,
        lr=0.1,
        momentum=0.9,
        push_every=64,
        batch_size=8,
        progress=False,
        epoch_quorum=1.0,
        **kwargs,
    )


def test_sigkill_of_a_train_worker_mid_epoch_applies_every_image_once(
    torch, store, cluster, tmp_path
):

    t = _module_trainer(
        torch, store, cluster, slow_replicas={0: 0.1, 1: 0.1}, checkpoint=str(tmp_path / "ckpt")
    )
    th, box = fit_in_background(t, epochs=1)
    _wait_for_images(t, 256, box)
    victim = workers_with_role(cluster, TRAIN)[0]
    hard_kill(cluster, [victim])
    join_fit(th, cluster, 300)
    assert "error" not in box, box.get("error")
    rec = box["history"].records[0]
    assert rec["images_applied"] == 1024  # nothing lost, nothing applied twice
    assert rec["images"] < 1024 + 512  # the re-run went on from the recorded position
    assert victim not in rec["replica_workers"]
    assert rec["test_accuracy"] > 0.2  # learning, not diverged
    t.close()
    # and the cluster heals: the victim's nanny starts a fresh TRAIN worker
    assert victim not in wait_role_workers(cluster, TRAIN, 2)


def test_a_user_module_trains_as_the_pipelines_one_stage(torch, store, cluster, epoch_runs):
    """A user's module (no layer list) trains as the partition pipeline's one stage, by the
    module's own fused step (forward, loss, backward and the update kernel), with each
    thread's velocity: every image applied once, above chance."""
    # a replica per TRAIN worker present: both, not one while a killed one's nanny restarts it
    wait_role_workers(cluster, TRAIN, 2)
    t = _module_trainer(torch, store, cluster)
    try:
        rec = t.fit(epochs=1).records[0]
    finally:
        t.close()
    (run,) = epoch_runs
    assert [(r.partitions, r.attempts) for r in run.results] == [(1, 1), (1, 1)]
    assert rec["images_applied"] == 1024
    assert rec["test_accuracy"] > 0.2  # chance is 0.1
