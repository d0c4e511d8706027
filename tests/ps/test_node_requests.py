"""The typed data-path requests (adam_dask.ps.protocol.node_requests): every field survives the
wire as the transports send it (msgpack, the data plane's and the Dask call's header alike), a
client request's part for one primary names only its shards, and a header of no known kind is
refused with what would have been accepted."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from adam_dask.ps.protocol.mark import Mark
from adam_dask.ps.protocol.node_requests import (
    ConfirmedRequest,
    OuterRequest,
    PullRequest,
    PushRequest,
    node_request,
    request_from_wire,
)
from adam_dask.ps.protocol.request import Outer, Request

SHARDS = [(0, 4), (4, 8), (8, 10)]
MARK = Mark(2, 1, 7, 0, 1, 3, None, (0, 2))


def over_the_wire(r):
    packed = msgpack.packb(r.to_wire(), use_bin_type=True)
    return request_from_wire(msgpack.unpackb(packed, raw=False, strict_map_key=False))


@pytest.mark.parametrize(
    "r",
    [
        PushRequest("s", {0: 3, 2: 1}, 99, "replay", ((0, 0, 4), (2, 8, -1)), MARK, True,
                    {0: 5, 2: 6}, 4, 0, PullRequest("s", (0, 2), {0: 3, 2: 1}, None, (4, 2))),
        PushRequest("s", {1: 0}, 1, "all", ((1, 4, 4),)),
        OuterRequest("s", {0: 1}, 5, "primary", 3, 2, 2, -0.5, 8, {0: (0, 2)}, MARK, True,
                     {0: 9}),
        PullRequest("s", (0, 1), {0: 2, 1: 2}, 7),
        ConfirmedRequest("s", (2, 0), True),
    ],
)  # fmt: skip
def test_every_field_survives_the_wire(r):
    assert over_the_wire(r) == r


def test_a_push_part_names_its_shards_bases_and_urgency():
    values = np.arange(10, dtype=np.float32)
    req = Request("push", (0, 1, 2), 11, "replay", MARK, values=values, urgent=True,
                  nonzero={0: True, 1: False, 2: True}, bases={0: 4, 2: 5}, pull=True)  # fmt: skip
    r = node_request(req, (1, 2), {1: 3, 2: 3}, "s", SHARDS)
    assert isinstance(r, PushRequest)
    assert r.parts == ((1, 4, -1), (2, 8, 2))  # shard 1 all zeros: nothing sent
    assert r.bases == {2: 5} and r.urgent and r.mark == MARK
    assert r.pull is not None and r.pull.sids == (1, 2)
    ev = over_the_wire(r).event(None, {1: None, 2: values[8:]}, False)
    assert (ev.push_id, ev.ack, ev.bases, ev.stamps) == (11, "replay", {2: 5}, {1: 3, 2: 3})


def test_an_offload_part_carries_its_columns():
    o = Outer(0, 3, 2, 0.5, np.ones((4, 3), np.float32), np.ones((4, 2), np.float32),
              {0: (0, 2), 1: (2, 3)})  # fmt: skip
    req = Request("push", (0, 1), 3, "replay", None, outer=o, bases={1: 2})
    r = node_request(req, (1,), {1: 0}, "s", SHARDS)
    assert isinstance(r, OuterRequest)
    assert (r.cols, r.batch, r.bases) == ({1: (2, 3)}, 4, {1: 2})


def test_a_header_of_no_known_kind_is_refused():
    with pytest.raises(ValueError, match="push, pull or confirmed"):
        request_from_wire({"op": "flush", "server": "s"})
    with pytest.raises(ValueError, match="control call"):
        node_request(Request("marks", (0,)), (0,), {}, "s", SHARDS)
