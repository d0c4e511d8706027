"""pipelines/reprocess.py on S3 (moto's server on 127.0.0.1): raw IDX files to a Zarr store with
pre-augmented epochs beside it, on a cluster; a rerun after a crash continues where it stopped
and no store ever looks complete before it is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import s3fs

from adam_dask.data.augment import Augment
from adam_dask.data.datasets import open_split
from adam_dask.errors import DatasetError
from adam_dask.testing import synthetic_digits, write_mnist_like

PIPELINE = str(Path(__file__).parents[2] / "pipelines" / "reprocess.py")
# small shards and blocks, so a small dataset makes many blocks
SMALL = {"DASK_ADAM__DATA__SHARD_IMAGES": "256", "DASK_ADAM__DATA__INGEST_BLOCK_IMAGES": "256"}


@pytest.fixture
def raw(s3, tmp_path):
    """IDX files in the bucket under raw/; yields (bucket URL, storage options)."""
    bucket, opts = s3
    src = write_mnist_like(tmp_path / "src", n_train=2048, n_test=256)
    s3fs.S3FileSystem(**opts).put(str(src) + "/", f"{bucket[5:]}/raw/", recursive=True)
    return bucket, opts


def start(local_client, opts, *argv):
    return subprocess.Popen(
        [
            sys.executable,
            PIPELINE,
            *argv,
            "--scheduler",
            local_client.scheduler.address,
            "--storage-options",
            json.dumps(opts),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **SMALL),
    )


def finish(proc, timeout=280):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def expected_epoch(images: np.ndarray, start: int, stop: int, epoch: int) -> np.ndarray:
    x = Augment.from_config().apply(images[start:stop], np.arange(start, stop), seed=0, epoch=epoch)
    return np.rint(np.clip(x, 0, 1) * 255).astype(np.uint8)[:, 0]


def test_reprocess_s3_writes_the_store_and_augmented_epochs(raw, local_client):
    bucket, opts = raw
    dest, aug = f"{bucket}/mnist.zarr", f"{bucket}/mnist-augmented"
    proc = start(local_client, opts, f"{bucket}/raw", dest, "--augmented-epochs", "2")
    result, err = finish(proc)
    assert result["dataset"]["ingested"] is True and result["dataset"]["images"] == 2304
    assert result["augmented"] == {
        "url": aug,
        "epochs": [0, 1],
        "blocks_written": 16,
        "blocks_skipped": 0,
    }
    for text in (opts["key"], opts["secret"]):
        assert text not in json.dumps(result) + err
    images, labels = synthetic_digits(2048, seed=0)
    train = open_split(dest, "train", opts)
    np.testing.assert_array_equal(train.images[:], images)
    epochs = [open_split(f"{aug}/epoch-{e:04d}", "train", opts) for e in (0, 1)]
    for e, split in enumerate(epochs):
        assert split.attrs["epoch"] == e and split.attrs["sha256"]
        assert split.images.shards == train.images.shards  # laid out like the source
        np.testing.assert_array_equal(split.labels[:], labels)
        for start_ in (0, 1792):
            np.testing.assert_array_equal(
                split.images[start_ : start_ + 256], expected_epoch(images, start_, start_ + 256, e)
            )
    assert (epochs[0].images[:256] != epochs[1].images[:256]).any()  # every epoch its own draws
    listed = json.loads(s3fs.S3FileSystem(**opts).cat_file(f"{aug[5:]}/augmented.json"))
    assert listed["epochs"] == [0, 1]

    # run again: nothing to do, everything kept
    result, _ = finish(start(local_client, opts, f"{bucket}/raw", dest, "--augmented-epochs", "2"))
    assert result["dataset"]["ingested"] is False
    assert result["augmented"]["blocks_written"] == 0


def test_reprocess_s3_continues_after_a_crash(raw, local_client):
    """SIGKILL the job in the middle of the augmented epochs: no epoch looks complete, and the
    rerun writes only the blocks that were missing."""
    bucket, opts = raw
    dest, aug = f"{bucket}/mnist.zarr", f"{bucket}/mnist-augmented"
    fs = s3fs.S3FileSystem(**opts)
    argv = (f"{bucket}/raw", dest, "--augmented-epochs", "3")
    proc = start(local_client, opts, *argv)
    progress = f"{aug[5:]}/_progress/epoch-0000"
    deadline = time.time() + 240
    while True:  # until the first block of epoch 0 is written
        fs.invalidate_cache()
        if fs.exists(progress) and fs.ls(progress):
            break
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    fs.invalidate_cache()
    assert not fs.exists(f"{aug[5:]}/augmented.json")
    for e in range(3):  # a crashed epoch is refused, never read as complete
        with pytest.raises(DatasetError):
            open_split(f"{aug}/epoch-{e:04d}", "train", opts)

    result, err = finish(start(local_client, opts, *argv))
    assert result["dataset"]["ingested"] is False  # the store was complete before the crash
    done = result["augmented"]
    assert done["epochs"] == [0, 1, 2]
    assert done["blocks_skipped"] >= 1 and done["blocks_written"] >= 1
    assert done["blocks_skipped"] + done["blocks_written"] == 24
    images, _ = synthetic_digits(2048, seed=0)
    for e in range(3):
        split = open_split(f"{aug}/epoch-{e:04d}", "train", opts)
        np.testing.assert_array_equal(split.images[:], expected_epoch(images, 0, 2048, e))


def test_reprocess_s3_redoes_an_interrupted_ingest_and_refuses_foreign_data(raw, local_client):
    import zarr

    from adam_dask.storage import zarr_store

    bucket, opts = raw
    dest = f"{bucket}/mnist.zarr"
    finish(start(local_client, opts, f"{bucket}/raw", dest))
    # what an ingest killed before its end leaves: a split not marked complete, no root splits
    root = zarr.open_group(store=zarr_store(dest, opts, read_only=False), mode="r+")
    root["test"].attrs["complete"] = False
    root.attrs["splits"] = []
    result, err = finish(start(local_client, opts, f"{bucket}/raw", dest))
    assert result["dataset"]["ingested"] is True
    assert "interrupted ingest" in err
    assert len(open_split(dest, "test", opts)) == 256

    fs = s3fs.S3FileSystem(**opts)
    fs.pipe_file(f"{bucket[5:]}/other/notes.txt", b"not a dataset")
    fs.copy(f"{bucket[5:]}/raw/", f"{bucket[5:]}/raw2/", recursive=True)
    for src, dest_, words in (
        (f"{bucket}/raw", f"{bucket}/other", "is not a dataset store"),
        (f"{bucket}/raw2", dest, f"made from {bucket}/raw/"),  # another source's store
    ):
        proc = start(local_client, opts, src, dest_)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", err[-2000:]
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[-1].startswith("error: ") and words in lines[-1], lines[-1]
        assert [line for line in lines if line.startswith("error: ")] == [lines[-1]]
