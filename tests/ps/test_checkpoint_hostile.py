"""A checkpoint from a place we do not trust: a manifest whose size, shards or block paths are
not what this parameter server writes, or a block with a codec that is not ours, gives one clear
error (:class:`CheckpointError`) and allocates nothing large."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from adam_dask.errors import CheckpointError
from adam_dask.model.layout import shard_ranges
from adam_dask.ps.checkpoint import (
    init_checkpoint,
    manifest_unreachable,
    read_checkpoint,
    read_manifest,
)

SHARD = 1 << 12
N = 3 * (SHARD // 4) + 5  # 4 shards


@pytest.fixture(scope="module")
def written(ps_client, tmp_path_factory) -> Path:
    """A real checkpoint: pushed, flushed and closed."""
    from adam_dask.ps import ParameterServer

    folder = tmp_path_factory.mktemp("hostile") / "ckpt"
    s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD, checkpoint=f"file://{folder}")
    try:
        s.push(np.full(N, 2.0, np.float32))
        s.flush(epoch=1)
    finally:
        s.close()
    return folder


def tampered(written: Path, tmp_path: Path, change) -> str:
    """A copy of the checkpoint whose manifest ``change(m)`` edited."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(written, copy)
    m = json.loads((copy / "manifest.json").read_text())
    change(m)
    (copy / "manifest.json").write_text(json.dumps(m))
    return f"file://{copy}"


def test_the_untouched_checkpoint_reads(written):
    _, values = read_checkpoint(f"file://{written}")
    np.testing.assert_array_equal(values, np.full(N, 2.0, np.float32))


def huge(m: dict) -> None:  # consistent with itself: one shard of 10^13 floats
    m.update(size=10**13, shard_bytes=4 * 10**13, shards=[[0, 10**13]])
    m.update(blocks=m["blocks"][:1], versions=m["versions"][:1])


def escape(m: dict) -> None:
    m["blocks"][1] = "shards/../../../../etc/passwd"


def gaps(m: dict) -> None:
    m["shards"][1][0] += 1


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (huge, "would not fit in memory"),
        (escape, "is not inside the checkpoint"),
        (gaps, "not contiguous"),
        (lambda m: m.update(size=-5), "do not cover size"),
        (lambda m: m.pop("shards"), "missing or malformed"),
    ],
)
def test_a_hostile_manifest_is_refused_before_anything_large(written, tmp_path, change, says):
    url = tampered(written, tmp_path, change)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=says) as err:
            read_checkpoint(url)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20, peak  # nothing of the claimed size was allocated
    assert "\n" not in str(err.value)


def test_a_block_with_a_foreign_codec_is_refused(written, tmp_path):
    url = tampered(written, tmp_path, lambda m: None)
    copy = Path(url.removeprefix("file://"))
    block = copy / json.loads((copy / "manifest.json").read_text())["blocks"][0] / "zarr.json"
    meta = json.loads(block.read_text())
    meta["codecs"].append({"name": "numcodecs.pickle", "configuration": {}})
    block.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(url)
    assert "codec" in str(err.value) or "not" in str(err.value)


def test_the_scheduler_s_probe_tells_a_missing_or_another_storage_from_the_checkpoint(tmp_path):
    """What the controller checks before a server is made: it reads back the manifest the job
    wrote (the same one, not a folder of the same name on another disk) and writes it again;
    a path that is not there is not made."""
    shards = shard_ranges(100, 256)

    def made(url: str, server: str) -> dict:
        return init_checkpoint(
            url, None, size=100, shard_bytes=256, shards=shards, server_id=server
        )

    doc = made(str(tmp_path / "ck"), "s1")
    assert manifest_unreachable(str(tmp_path / "ck"), None, doc) is None
    assert read_manifest(str(tmp_path / "ck"))["server"] == "s1"
    why = manifest_unreachable(str(tmp_path / "gone" / "ck"), None, doc)
    assert why is not None and why.startswith("cannot read ") and "FileNotFoundError" in why
    assert not (tmp_path / "gone").exists()
    made(str(tmp_path / "other"), "s2")  # the same shape, another server's
    why = manifest_unreachable(str(tmp_path / "other"), None, doc)
    assert why is not None and "another storage" in why
    assert read_manifest(str(tmp_path / "other"))["server"] == "s2"  # left as it was
