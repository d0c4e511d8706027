"""The parameter server keeps credentials where they are needed: the nodes write back with the
storage options they got when made, but the routing every pusher reads, and a copy of the
handle sent to a task, carry none; the manifest stores URLs without their credentials."""

from __future__ import annotations

import json
import pickle

import numpy as np
import s3fs

from adam_dask.cluster import workers_with_role
from adam_dask.ps.checkpoint import read_checkpoint

SENTINEL = "SENTINEL-4b1d90ce"  # in every credential; moto checks none of them
SHARD = 1 << 14
N = 3 * (SHARD // 4) + 7  # 4 shards


def pull_in_a_task(server) -> tuple[float, str]:
    """What a pusher on a TRAIN worker sees: the values, and the routing it reads."""
    return float(server.pull().sum()), json.dumps(server.routing_info(), default=str)


def test_pushers_get_no_storage_options_and_the_manifest_no_url_credentials(
    ps_client, make_server, s3
):
    bucket, opts = s3
    secret = dict(opts, key=f"{SENTINEL}-key", secret=f"{SENTINEL}-secret", token=f"{SENTINEL}-t")
    data_url = f"https://reader:{SENTINEL}-pw@data.example/d.zarr?X-Amz-Signature={SENTINEL}-sig"
    url = f"{bucket}/ckpt"
    s = make_server(
        size=N, shard_bytes=SHARD, checkpoint=url, storage_options=secret, meta={"data": data_url}
    )
    s.push(np.ones(N, np.float32))
    s.flush(epoch=1, meta={"data": data_url})

    assert SENTINEL not in json.dumps(s.routing_info(), default=str)
    assert SENTINEL.encode() not in pickle.dumps(s)
    (train,) = workers_with_role(ps_client, "TRAIN")
    total, routing = ps_client.submit(pull_in_a_task, s, workers=[train], pure=False).result()
    assert total == N  # the handle a task gets still pushes and pulls
    assert SENTINEL not in routing

    # the nodes wrote back with the options they were given when made
    manifest, values = read_checkpoint(url, opts)
    np.testing.assert_array_equal(values, np.ones(N, np.float32))
    assert manifest["epoch"] == 1
    assert manifest["meta"]["data"] == "https://***@data.example/d.zarr?X-Amz-Signature=***"
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    stored = {p: fs.cat_file(p) for p in fs.find(bucket[len("s3://") :])}
    assert any(p.endswith("ckpt/manifest.json") for p in stored)
    assert not [p for p, data in stored.items() if SENTINEL.encode() in data]
