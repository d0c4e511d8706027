"""``adam-dask show RUN``: a run's summary from its folder, its curves as a PNG, bad input as
one error line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adam_dask.cli import run
from adam_dask.model.layout import shard_ranges
from adam_dask.model.network import Network
from adam_dask.ps.checkpoint import init_checkpoint
from adam_dask.train.metrics import History

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
RECORDS = [
    {"epoch": 0, "loss": 0.52, "test_accuracy": 0.91, "images": 6000, "images_applied": 6000,
     "images_per_second": 3000.0, "seconds": 2.0},
    {"epoch": 1, "loss": 0.21, "test_accuracy": 0.97, "images": 6000, "images_applied": 6000,
     "images_per_second": 2000.0, "seconds": 3.0},
    {"epoch": 2, "loss": 0.15, "test_accuracy": 0.96, "images": 6000, "images_applied": 6000,
     "images_per_second": 6000.0, "seconds": 1.0},
]  # fmt: skip


@pytest.fixture
def run_folder(tmp_path):
    """A run folder as adam-dask train leaves it: a checkpoint naming its model and mode, and
    the history appended every epoch."""
    folder = tmp_path / "20261126-120000-abc123"
    net = Network.from_spec(SPEC, input_shape=(1, 28, 28))
    size = net.flat.size
    init_checkpoint(
        str(folder),
        None,
        size=size,
        shard_bytes=1 << 14,
        shards=shard_ranges(size, 1 << 14),
        values=net.flat,
        epoch=2,
        meta={"model": net.to_dict(), "mode": "async", "epochs": 5},
    )
    History(records=RECORDS).save(str(folder / "history.jsonl"))
    return folder


def show(capsys, *argv):
    status = run(["show", *argv])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return status, (json.loads(lines[-1]) if status == 0 else None), err


def test_show_prints_the_summary_and_draws_the_curves(run_folder, capsys):
    status, result, err = show(capsys, str(run_folder))
    assert status == 0, err
    assert result["epochs"] == 3 and result["epoch"] == 2 and result["epochs_planned"] == 5
    assert result["test_accuracy"] == 0.96
    assert (result["best_accuracy"], result["best_epoch"]) == (0.97, 1)
    assert result["images_per_second"] == 3000.0  # 18,000 images in 6 s, not a mean of rates
    assert result["model"] == SPEC and result["mode"] == "async"
    assert result["checkpoint_epoch"] == 2 and result["images_applied"] == 18000
    assert "97.00%" in err  # the table of the epochs
    png = run_folder / "curves.png"
    assert result["curves"].endswith("curves.png") and png.exists()
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[1] > 2 * img.shape[0]  # three panels side by side
    assert float(np.std(img[..., :3])) > 0.05  # something is drawn


def test_show_writes_the_png_where_asked_or_not_at_all(run_folder, tmp_path, capsys):
    target = tmp_path / "elsewhere.png"
    status, result, err = show(capsys, str(run_folder), "--png", str(target))
    assert status == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run_folder / "curves.png").exists()
    status, result, err = show(capsys, str(run_folder), "--no-png")
    assert status == 0 and result["curves"] is None, err


def test_a_history_without_a_checkpoint_is_still_shown(run_folder, capsys):
    (run_folder / "manifest.json").unlink()  # interrupted before its first commit
    status, result, err = show(capsys, str(run_folder), "--no-png")
    assert status == 0, err
    assert result["epochs"] == 3 and result["model"] is None


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: None, ["no training history at", "give a run folder"]),
        (lambda d: (d / "history.jsonl").write_text(""), ["no finished epoch yet"]),
        (lambda d: (d / "history.jsonl").write_text("{oops\n"), ["is not a training history"]),
    ],
    ids=["no-history", "empty", "not-json"],
)
def test_bad_run_folders_are_one_error_line(tmp_path, capsys, make, words):
    folder = tmp_path / "run"
    folder.mkdir()
    make(folder)
    status, _, err = show(capsys, str(folder))
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), lines[0]


def test_without_matplotlib_the_png_is_refused_in_one_line(run_folder, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    status, _, err = show(capsys, str(run_folder))
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    assert "needs matplotlib" in lines[0] and "--no-png" in lines[0]
    status, result, err = show(capsys, str(run_folder), "--no-png")
    assert status == 0 and result["epochs"] == 3, err
