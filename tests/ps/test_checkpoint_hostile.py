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
from adam_dask.ps.checkpoint import read_checkpoint

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
