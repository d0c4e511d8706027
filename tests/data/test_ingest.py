"""adam-dask ingest and info: IDX and image-folder sources, local and S3, and every bad input."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import zarr
from PIL import Image

from adam_dask.cli import run
from adam_dask.data.datasets import open_split
from adam_dask.data.ingest import parse_idx, read_idx
from adam_dask.errors import DatasetError, SourceError
from adam_dask.testing import synthetic_digits, write_idx, write_mnist_like


def cli(capsys, *argv):
    """Run the CLI in-process; returns (status, last stdout line parsed or None, stderr)."""
    status = run(list(argv))
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    result = json.loads(lines[-1]) if status == 0 and lines else None
    return status, result, captured.err


def assert_clean_error(status, err, *words):
    assert status == 2
    # what a terminal shows: a progress bar redraws its line with \r, the last draw stays
    lines = [l.split("\r")[-1] for l in err.split("\n")]
    lines = [l for l in lines if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]


def assert_not_complete(url, storage_options=None):
    with pytest.raises(DatasetError):
        open_split(url, "train", storage_options)


# -- IDX ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_idx_ingest_equals_source(tmp_path, capsys, gz):
    src = write_mnist_like(tmp_path / "src", n_train=600, n_test=130, gz=gz)
    dest = tmp_path / "store"
    status, result, err = cli(capsys, "ingest", str(src), str(dest))
    assert status == 0, err
    assert result["images"] == 730 and result["shape"] == [28, 28]
    assert result["classes"] == [str(i) for i in range(10)]
    for split, prefix, n, seed in (("train", "train", 600, 0), ("test", "t10k", 130, 1)):
        images, labels = synthetic_digits(n, seed=seed)
        s = open_split(str(dest), split)
        np.testing.assert_array_equal(s.images[:], images)
        np.testing.assert_array_equal(s.labels[:], labels)
        assert s.attrs["sha256"] == hashlib.sha256(images.tobytes()).hexdigest()
        assert result["sha256"][split] == s.attrs["sha256"]
        assert s.attrs["source"].endswith(f"{prefix}-images-idx3-ubyte" + (".gz" if gz else ""))
        assert s.input_shape == (1, 28, 28)


def test_blocks_and_shards_written_by_several_tasks(tmp_path, capsys, local_client):
    """Several Dask tasks (process workers) each write whole shards; the result is exact."""
    from adam_dask.data.ingest import ingest

    src = write_mnist_like(tmp_path / "src", n_train=700, n_test=64)
    summary = ingest(
        str(src),
        str(tmp_path / "s"),
        client=local_client,
        chunk_images=64,
        shard_images=128,
        block_images=256,
    )
    assert summary["images"] == 764
    s = open_split(str(tmp_path / "s"), "train")
    assert s.images.chunks[0] == 64 and s.images.shards[0] == 128
    np.testing.assert_array_equal(s.images[:], synthetic_digits(700, seed=0)[0])


def test_single_pair_writes_train_only(tmp_path, capsys):
    src = tmp_path / "one"
    src.mkdir()
    images, labels = synthetic_digits(50, seed=3)
    write_idx(src / "emnist-images-idx3-ubyte.gz", images)
    write_idx(src / "emnist-labels-idx1-ubyte.gz", labels)
    status, result, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert status == 0, err
    assert list(result["splits"]) == ["train"]
    assert "test" not in zarr.open_group(str(tmp_path / "d"), mode="r")


def test_read_idx_parses_header(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    np.testing.assert_array_equal(read_idx(str(write_idx(tmp_path / "a.gz", a))), a)
    with pytest.raises(SourceError, match="magic"):
        parse_idx(b"\x12\x34\x08\x01" + b"\x00" * 8)


# -- image folders -----------------------------------------------------------------------------------


def write_png_folder(root, per_class=6, size=(20, 24), rgb_one=False, seed=0):
    rng = np.random.default_rng(seed)
    for c, name in enumerate(["cat", "dog", "eel"]):
        d = root / name
        d.mkdir(parents=True)
        for i in range(per_class):
            arr = rng.integers(0, 255, size, dtype=np.uint8)
            Image.fromarray(arr, "L").save(d / f"{i:03d}.png")
    if rgb_one:
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8), "RGB").save(
            root / "dog" / "rgb.png"
        )
    return root


def test_image_folder_ingest(tmp_path, capsys):
    src = write_png_folder(tmp_path / "src")
    # one image of another size: resized to the most common size
    Image.fromarray(np.full((40, 40), 200, np.uint8), "L").save(src / "eel" / "big.png")
    status, result, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert status == 0, err
    s = open_split(str(tmp_path / "d"), "train")
    assert s.classes == ["cat", "dog", "eel"]
    assert len(s) == 19 and s.image_shape == (20, 24)
    labels = s.labels[:]
    assert list(np.bincount(labels)) == [6, 6, 7]
    first = np.asarray(Image.open(src / "cat" / "000.png"))
    np.testing.assert_array_equal(s.images[0], first)
    big = s.images[int(np.flatnonzero(labels == 2)[-1])]
    assert big.shape == (20, 24) and abs(int(big.mean()) - 200) <= 1


def test_image_folder_rgb_rule_and_explicit_size(tmp_path, capsys):
    src = write_png_folder(tmp_path / "src", rgb_one=True)
    status, result, err = cli(
        capsys, "ingest", str(src), str(tmp_path / "d"), "--image-size", "16x16"
    )
    assert status == 0, err
    s = open_split(str(tmp_path / "d"), "train")
    assert s.image_shape == (16, 16, 3) and s.input_shape == (3, 16, 16)
    assert s.attrs["image_mode"] == "RGB"


def test_bad_image_fails_or_is_skipped(tmp_path, capsys, caplog):
    src = write_png_folder(tmp_path / "src")
    (src / "dog" / "notes.png").write_text("not an image")
    status, _, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert_clean_error(status, err, "notes.png", "--on-bad-image skip")
    assert not (tmp_path / "d").exists()
    status, result, err = cli(
        capsys, "ingest", str(src), str(tmp_path / "d"), "--on-bad-image", "skip"
    )
    assert status == 0, err
    assert result["splits"]["train"]["skipped"] == 1
    assert "notes.png" in caplog.text  # the warning lists it
    assert len(open_split(str(tmp_path / "d"), "train")) == 18


# -- bad input ------------------------------------------------------------------------------------------


def test_truncated_gzip(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src")
    f = src / "train-images-idx3-ubyte.gz"
    f.write_bytes(f.read_bytes()[:-200])
    status, _, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert_clean_error(status, err, "train-images-idx3-ubyte.gz", "truncated")
    assert not (tmp_path / "d").exists()


def test_wrong_magic(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src")
    images, _ = synthetic_digits(300, seed=0)
    write_idx(src / "train-images-idx3-ubyte.gz", images, magic=0x00000123)
    status, _, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert_clean_error(status, err, "magic")


def test_count_mismatch(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src")
    write_idx(src / "train-labels-idx1-ubyte.gz", np.zeros(299, np.uint8))
    status, _, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert_clean_error(status, err, "300 images", "299 labels")
    assert not (tmp_path / "d").exists()


def test_label_out_of_range(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src")
    labels = np.zeros(100, np.uint8)
    labels[17] = 12
    write_idx(src / "t10k-labels-idx1-ubyte.gz", labels)
    status, _, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert_clean_error(status, err, "class 12 at index 17", "--num-classes 13")
    assert_not_complete(str(tmp_path / "d"))
    status, result, err = cli(
        capsys, "ingest", str(src), str(tmp_path / "d"), "--num-classes", "13"
    )
    assert status == 0, err
    assert len(result["classes"]) == 13


def test_empty_source(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    status, _, err = cli(capsys, "ingest", str(tmp_path / "empty"), str(tmp_path / "d"))
    assert_clean_error(status, err, "empty")
    status, _, err = cli(capsys, "ingest", str(tmp_path / "missing"), str(tmp_path / "d"))
    assert_clean_error(status, err, "does not exist")


def test_destination_exists(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src", n_train=40, n_test=20)
    assert cli(capsys, "ingest", str(src), str(tmp_path / "d"))[0] == 0
    before = open_split(str(tmp_path / "d"), "train").images[:]
    write_mnist_like(src, n_train=50, n_test=20, seed=5)
    status, _, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    assert_clean_error(status, err, "already exists", "--overwrite")
    np.testing.assert_array_equal(open_split(str(tmp_path / "d"), "train").images[:], before)
    status, result, err = cli(capsys, "ingest", str(src), str(tmp_path / "d"), "--overwrite")
    assert status == 0 and result["splits"]["train"]["images"] == 50


def test_interrupted_split_is_refused(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src", n_train=40, n_test=20)
    assert cli(capsys, "ingest", str(src), str(tmp_path / "d"))[0] == 0
    g = zarr.open_group(str(tmp_path / "d" / "train"), mode="r+")
    g.attrs["complete"] = False  # what an interrupted ingest leaves behind
    with pytest.raises(DatasetError, match="incomplete"):
        open_split(str(tmp_path / "d"), "train")


# -- info ------------------------------------------------------------------------------------------------


def test_info(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src", n_train=300, n_test=100)
    cli(capsys, "ingest", str(src), str(tmp_path / "d"))
    status, result, err = cli(capsys, "info", str(tmp_path / "d"))
    assert status == 0, err
    assert set(result["splits"]) == {"train", "test"}
    assert result["splits"]["train"]["images"] == 300
    assert result["splits"]["train"]["chunk_images"] == 256
    status, _, err = cli(capsys, "info", str(tmp_path / "nothing"))
    assert_clean_error(status, err, "no dataset store", "adam-dask ingest")


# -- S3 (moto's server on 127.0.0.1) -------------------------------------------------------------------


def test_s3_to_s3_with_process_workers(tmp_path, s3, local_client):
    """From an S3 source into an S3 store; the writes happen in worker processes."""
    import s3fs

    from adam_dask.data.ingest import ingest

    bucket, opts = s3
    src = write_mnist_like(tmp_path / "src", n_train=300, n_test=100)
    fs = s3fs.S3FileSystem(**opts)
    fs.put(str(src) + "/", f"{bucket[5:]}/raw/", recursive=True)
    summary = ingest(
        f"{bucket}/raw", f"{bucket}/mnist.zarr", client=local_client, storage_options=opts
    )
    assert summary["images"] == 400
    s = open_split(f"{bucket}/mnist.zarr", "test", opts)
    np.testing.assert_array_equal(s.images[:], synthetic_digits(100, seed=1)[0])


def test_aws_environment_variables(tmp_path, s3, monkeypatch, capsys):
    import s3fs

    bucket, opts = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    s3fs.S3FileSystem.clear_instance_cache()
    src = write_mnist_like(tmp_path / "src", n_train=60, n_test=20)
    status, result, err = cli(capsys, "ingest", str(src), f"{bucket}/env.zarr")
    assert status == 0, err
    status, result, err = cli(capsys, "info", f"{bucket}/env.zarr")
    assert status == 0 and result["splits"]["train"]["images"] == 60


def test_unreachable_s3_endpoint(tmp_path, capsys):
    src = write_mnist_like(tmp_path / "src", n_train=40, n_test=20)
    opts = json.dumps(
        {
            "key": "k",
            "secret": "s",
            "endpoint_url": "http://127.0.0.1:9",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        }
    )
    status, _, err = cli(
        capsys, "ingest", str(src), "s3://nobucket/x.zarr", "--storage-options", opts
    )
    assert_clean_error(status, err, "127.0.0.1:9")


def test_mnist_alias_and_md5sums(tmp_path, capsys, monkeypatch):
    """`ingest mnist` takes $ADAM_DASK_MNIST and checks the files against its MD5SUMS."""
    src = tmp_path / "mnist"
    src.mkdir()
    for prefix, n, seed in (("train", 80, 0), ("t10k", 30, 1)):
        images, labels = synthetic_digits(n, seed=seed)
        write_idx(src / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", labels)
    sums = "".join(
        f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sorted(src.iterdir())
    )
    (src / "MD5SUMS").write_text(sums)
    monkeypatch.setenv("ADAM_DASK_MNIST", str(src))
    status, result, err = cli(capsys, "ingest", "mnist", str(tmp_path / "d"))
    assert status == 0, err
    assert result["splits"]["train"]["images"] == 80 and result["splits"]["test"]["images"] == 30
    (src / "MD5SUMS").write_text(sums.replace(sums[:8], "00000000", 1))
    status, _, err = cli(capsys, "ingest", "mnist", str(tmp_path / "d2"))
    assert_clean_error(status, err, "MD5", "download it again")
    assert not (tmp_path / "d2").exists()
