"""The PS controller as a pure state machine (no Dask): liveness, fencing before promotion,
restore from the checkpoint, the single manifest writer."""

from __future__ import annotations

import logging

import pytest

from adam_dask.ps.protocol.controller import ServerState
from adam_dask.ps.protocol.controller_machine import handle
from adam_dask.ps.protocol.messages import (
    Beat,
    Call,
    CallDone,
    CallFailed,
    Commit,
    CreateNode,
    DeleteBlocks,
    ManifestDone,
    ManifestFailed,
    NodeReady,
    Reply,
    Retire,
    Tick,
    WorkerRemoved,
    WriteManifest,
    WriteReport,
)
from adam_dask.ps.protocol.replies import BeatReply, ReportReply

ADDRS = ["a", "b", "c", "d"]


def of(actions, kind):
    return [x for x in actions if isinstance(x, kind)]


@pytest.fixture
def ctl():
    """Two shards over a, b, c (d is a spare PS worker); a is the primary of both."""
    manifest = {
        "sequence": 0,
        "versions": [0, 0],
        "generations": [0, 0],
        "blocks": ["shards/0/g0-v0", "shards/1/g0-v0"],
        "epoch": None,
        "meta": {},
    }
    return ServerState(
        "s",
        [(0, 10), (10, 20)],
        target=3,
        routing={0: ["a", "b", "c"], 1: ["a", "c", "b"]},
        nodes={x: f"k{x}" for x in "abc"},
        workers={x: f"h{x}" for x in ADDRS},
        gens={0: 0, 1: 0},
        generation=0,
        manifest=manifest,
        now=0.0,
        heartbeat_timeout=2.0,
        retire_timeout=5.0,
        block_grace=1.0,
        retry_base=0.1,
        retry_max=1.0,
    )


def beat(ctl, addr, now, positions=None):
    return handle(ctl, Beat("r", addr, f"k{addr}", now, positions or {}))


def test_missed_heartbeats_fence_survivors_then_promote_the_newest(ctl):
    for t in (0.5, 1.0, 1.5, 2.0):
        for x in "bc":
            beat(ctl, x, t)
        assert not of(handle(ctl, Tick(t)), Retire)
    out = handle(ctl, Tick(2.1))  # a has been silent for 2.1 s
    assert ctl.declared_dead == 1 and "a" not in ctl.nodes
    assert not of(out, Retire)  # its worker goes only if it stays silent
    fences = {c.addr: c for c in of(out, Call) if c.method == "fence"}
    assert set(fences) == {"b", "c"}
    gens = fences["b"].args[0]
    assert set(gens) == {0, 1} and min(gens.values()) > 0
    assert ctl.pending() == {0, 1} and not ctl.healthy()
    out = handle(ctl, CallDone(fences["b"].op, {0: (0, 5), 1: (0, 9)}))
    assert not of(out, Call)  # c has not answered yet: nobody is promoted
    out = handle(ctl, CallDone(fences["c"].op, {0: (0, 7), 1: (0, 9)}))
    promotes = {c.args[0].popitem()[0]: c for c in of(out, Call) if c.method == "promote"}
    assert promotes[0].addr == "c"  # the newest copy of shard 0
    # while the promotions are in flight the shards have no primary to push to yet
    assert ctl.pending() == {0, 1} and "a" not in ctl.routing[0]
    for sid, call in promotes.items():
        handle(ctl, CallDone(call.op, {sid: 9}))
    assert ctl.routing[0][0] == "c" and "a" not in ctl.routing[0] + ctl.routing[1]
    assert ctl.gens[0] == gens[0] and not ctl.pending()


def test_survivors_never_filled_are_not_promoted_the_shard_is_restored(ctl):
    """The rule simulation seed 55436 broke: a backup added to replace a lost copy holds the
    shard at version -1 until its primary's first forward; when the primary and the other
    backup die before that forward arrives, the empty copy must not be promoted (the
    acknowledged pushes the checkpoint holds would be lost): the shard is rebuilt from the
    checkpoint, as when every copy is lost. A survivor with data is still promoted."""
    handle(ctl, WriteReport("w", "a", {0: (0, 9, "shards/0/g0-v9")}))
    handle(ctl, ManifestDone(1))
    out = []
    for x in "ab":
        out += handle(ctl, WorkerRemoved(x, 1.0))
    fences = {c.addr: c for c in of(out, Call) if c.method == "fence"}
    if "b" in fences:  # asked before b was lost too: that call fails
        out = handle(ctl, CallFailed(fences["b"].op, "b is gone"))
        fences.update({c.addr: c for c in of(out, Call) if c.method == "fence"})
    out = handle(ctl, CallDone(fences["c"].op, {0: (0, -1), 1: (0, 4)}))
    calls = of(out, Call)
    promoted = {c.args[0].popitem()[0] for c in calls if c.method == "promote"}
    assert promoted == {1}  # shard 1: c holds its data
    restores = [c for c in calls if c.method == "restore"]
    assert [r.args[0] for r in restores] == [0] and restores[0].args[4][0] == "shards/0/g0-v9"
    assert "c" not in ctl.routing[0]


def test_a_silent_worker_is_retired_a_slow_one_comes_back_empty(ctl):
    retired = []
    for i in range(1, 31):  # a is silent from the start; b from 5 s on; c always beats
        t = i * 0.5
        beat(ctl, "c", t)
        if t < 5:
            beat(ctl, "b", t)
        if t == 4.0:  # a was only slow: its node is out, its worker usable again
            r = beat(ctl, "a", t)
            assert of(r, Reply)[0].value == BeatReply(False, {})
            assert "a" in ctl.live() and "a" not in ctl.nodes
        retired += of(handle(ctl, Tick(t)), Retire)
        if t == 2.5:
            assert "a" not in ctl.nodes and "a" not in ctl.live()
    assert retired == [Retire("b")]  # silent past the retire timeout


def test_stale_writer_refused_manifest_never_goes_back(ctl):
    out = handle(ctl, WriteReport("w1", "a", {0: (0, 4, "shards/0/g0-v4")}))
    assert of(out, Reply)[0].value == ReportReply({0: 4}, {})
    (w1,) = of(out, WriteManifest)
    assert w1.doc["versions"] == [4, 0] and w1.doc["sequence"] == 1
    out = handle(ctl, WriteReport("w2", "b", {0: (0, 6, "shards/0/g0-v6")}))  # not the primary
    assert of(out, Reply)[0].value.refused == {0: 0} and ctl.refused_writes == 1
    out = handle(ctl, WriteReport("w3", "a", {0: (0, 3, "shards/0/g0-v3")}))  # older
    assert not of(out, WriteManifest)  # one write at a time
    handle(ctl, ManifestDone(1))
    assert ctl.manifest.position(0) == (0, 4)  # an older block never replaces a newer one
    out = handle(ctl, WriteReport("w4", "a", {0: (0, 8, "shards/0/g0-v8")}))
    (w2,) = of(out, WriteManifest)
    assert w2.doc["sequence"] == 2 and w2.doc["blocks"][0] == "shards/0/g0-v8"
    out = handle(ctl, ManifestDone(2))
    assert not of(out, DeleteBlocks)  # replaced less than block_grace ago: a reader may need it
    out = handle(ctl, Tick(1.5))
    deleted = [p for d in of(out, DeleteBlocks) for p in d.paths]
    assert deleted == ["shards/0/g0-v0"]  # g0-v4 was named by the previous manifest: kept


def test_a_manifest_outage_backs_off_is_logged_once_and_a_waiting_commit_is_answered_after(
    ctl, caplog
):
    """The scheduler can not write the manifest (its storage is out): the write is tried again
    after a back-off that doubles, one warning says it for the whole outage (not one per try),
    the controller's record shows it, and once a write succeeds the waiting commit is answered
    and the end of the outage is logged once."""
    caplog.set_level(logging.DEBUG, logger="adam_dask.ps.protocol.controller_manifest")
    (w,) = of(handle(ctl, WriteReport("w", "a", {0: (0, 4, "shards/0/g0-v4")})), WriteManifest)
    assert handle(ctl, Commit("c", 7, None)) == []  # answered once a manifest holds it
    handle(ctl, ManifestFailed(w.seq, "FileNotFoundError: no such folder", 0.0))
    # retry_base 0.1, doubling: tried again at 0.1 after the first failure, 0.2 after the second
    for early, due in ((0.09, 0.15), (0.3, 0.4)):
        assert not of(handle(ctl, Tick(early)), WriteManifest)
        (w,) = of(handle(ctl, Tick(due)), WriteManifest)
        handle(ctl, ManifestFailed(w.seq, "FileNotFoundError: no such folder", due))
    assert not of(handle(ctl, Tick(0.75)), WriteManifest)  # 0.4 after the third
    info = ctl.routing_info()
    assert info["manifest_failing"] == 3 and info["manifest_errors"] == 3
    assert info["last_manifest_error"] == "FileNotFoundError: no such folder"
    said = [r for r in caplog.records if "manifest" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG], said
    assert "training go on" in said[0].getMessage()
    (w,) = of(handle(ctl, Tick(0.85)), WriteManifest)
    assert w.doc["epoch"] == 7 and w.doc["versions"] == [4, 0]
    (answer,) = of(handle(ctl, ManifestDone(w.seq)), Reply)
    assert answer.req == "c" and answer.value["epoch"] == 7
    assert ctl.routing_info()["manifest_failing"] == 0
    back = [r for r in caplog.records if "written again" in r.getMessage()]
    assert len(back) == 1 and "after 3 failed tries" in back[0].getMessage()
    # a later outage is said again, once
    (w,) = of(handle(ctl, WriteReport("w2", "a", {0: (0, 5, "shards/0/g0-v5")})), WriteManifest)
    handle(ctl, ManifestFailed(w.seq, "PermissionError: read-only", 0.9))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "failed (" in r.msg]
    assert len(warned) == 2 and "read-only" in warned[1].getMessage()


def test_all_copies_lost_restores_from_the_checkpoint(ctl):
    beat(ctl, "a", 0.5, {1: (0, 12)})  # the primary had applied 12 updates to shard 1
    handle(ctl, WriteReport("w", "a", {1: (0, 9, "shards/1/g0-v9")}))
    handle(ctl, ManifestDone(1))
    out = []
    for x in "abc":
        out += handle(ctl, WorkerRemoved(x, 1.0))
    assert of(out, CreateNode) == [CreateNode("d")]  # the spare worker gets a node first
    assert ctl.pending() == {0, 1}
    out = handle(ctl, NodeReady("d", "kd", 1.1))
    restores = {c.args[0]: c for c in of(out, Call) if c.method == "restore"}
    assert restores[1].args[4] == ("shards/1/g0-v9", 0, 9) and restores[1].addr == "d"
    handle(ctl, CallDone(restores[1].op, 9))
    assert ctl.routing[1] == ["d"] and ctl.gens[1] > 0
    assert ctl.restored[-1] == {
        "shard": 1,
        "version": 9,
        "generation": ctl.gens[1],
        "lost_at_least": 3,
    }


def test_a_new_nodes_first_beat_before_its_ready_does_not_retire_it(ctl):
    """The node started on a worker beats before the answer to its start (NodeReady, with its
    key) reaches the controller: it is not told "no member" (it would stop serving for good
    while the controller counts it and places copies on it)."""
    out = []
    for x in "abc":
        out += handle(ctl, WorkerRemoved(x, 1.0))
    assert of(out, CreateNode) == [CreateNode("d")]
    early = handle(ctl, Beat("r1", "d", "kd", 1.05, {}))  # its first beat overtakes NodeReady
    assert of(early, Reply)[0].value.member
    assert "d" not in ctl.nodes  # only NodeReady makes it a node
    handle(ctl, NodeReady("d", "kd", 1.1))
    assert ctl.nodes["d"] == "kd"
    assert of(handle(ctl, Beat("r2", "d", "kd", 1.3, {})), Reply)[0].value.member
    # once no node is being created there, a stranger's beat is told it is no member
    assert not of(handle(ctl, Beat("r3", "d", "kd-old", 1.4, {})), Reply)[0].value.member


def test_most_nodes_silent_at_once_is_a_stall_not_a_massacre(ctl):
    retired = []
    for i in range(1, 15):  # only c beats: a and b are silent (a compiler, a swap storm...)
        t = i * 0.5
        beat(ctl, "c", t)
        if t > 5:
            beat(ctl, "b", t)  # b comes back after 5 s
        retired += of(handle(ctl, Tick(t)), Retire)
        if t == 3.0:  # 2 of 3 silent: nobody is declared dead yet
            assert ctl.declared_dead == 0 and ctl.healthy()
    assert ctl.declared_dead == 1 and "a" not in ctl.nodes and "b" in ctl.nodes
    assert not retired  # a's worker goes only after retire_timeout


def test_the_controller_cut_from_every_node_retires_none(ctl):
    """The scheduler's link cut for 15 s (three retire timeouts): no node beats, yet every
    worker stays; after the cut, silence counts again from its end."""
    retired = {}
    for i in range(1, 61):
        t = i * 0.5
        for x, back in (("a", 99.0), ("b", 16.5), ("c", 16.0)):  # a never speaks again
            if t <= 1.0 or t >= back:
                beat(ctl, x, t)
        for r in of(handle(ctl, Tick(t)), Retire):
            retired[r.addr] = t
        if t == 15.0:  # most nodes silent for 14 s: the controller doubts itself
            assert not retired and ctl.declared_dead == 0 and set(ctl.nodes) == {"a", "b", "c"}
    # b's beat ended the declaring spell at 16.5: a, silent, is declared dead then, and its
    # worker goes retire_timeout (5 s) after that, not at once for its 15 s of silence
    assert "a" not in ctl.nodes and {"b", "c"} <= set(ctl.nodes)
    assert list(retired) == ["a"] and 21.5 < retired["a"] <= 22.0


def test_most_nodes_frozen_for_good_are_retired_once_the_doubt_runs_out(ctl):
    """Two of three nodes frozen for good while the third beats: the controller first doubts
    itself (most nodes silent: its own link cut?) and retires none; after
    DOUBT_RETIRE_TIMEOUTS retire timeouts it retires the frozen ones (the way they heal),
    rather than leaving them to Dask's worker timeout."""
    from adam_dask.ps.protocol.controller import DOUBT_RETIRE_TIMEOUTS

    limit = DOUBT_RETIRE_TIMEOUTS * ctl.retire_timeout
    retired = {}
    for i in range(1, 121):
        t = i * 0.5
        beat(ctl, "c", t)
        if t <= 1.0:
            beat(ctl, "a", t)
            beat(ctl, "b", t)
        for r in of(handle(ctl, Tick(t)), Retire):
            retired[r.addr] = t
    assert set(retired) == {"a", "b"}
    # the doubt began once a and b missed their heartbeats, a few seconds after 1.0
    assert all(1.0 + limit < t <= 1.0 + ctl.timeout + limit + 1.0 for t in retired.values())


def test_a_stalled_controller_does_not_blame_the_nodes(ctl):
    for x in "abc":
        beat(ctl, x, 1.0)
    handle(ctl, Tick(1.0))
    out = handle(ctl, Tick(9.0))  # the scheduler's loop was blocked for 8 s
    assert not of(out, Retire) and set(ctl.nodes) == {"a", "b", "c"}


def test_the_story_says_why_a_shard_was_promoted(ctl):
    for t in (0.5, 1.0, 1.5, 2.0):
        for x in "bc":
            beat(ctl, x, t)
        handle(ctl, Tick(t))
    out = handle(ctl, Tick(2.1))  # a silent for 2.1 s: declared dead, survivors fenced
    fences = {c.addr: c for c in of(out, Call) if c.method == "fence"}
    handle(ctl, CallDone(fences["b"].op, {0: (0, 5), 1: (0, 9)}))
    out = handle(ctl, CallDone(fences["c"].op, {0: (0, 7), 1: (0, 9)}))
    promote = next(c for c in of(out, Call) if c.method == "promote" and 0 in c.args[0])
    handle(ctl, CallDone(promote.op, {0: 9}))
    story = ctl.story(0)
    events = [e.event.split("(")[0] for e in story]
    assert events[-4:] == ["Tick", "CallDone", "CallDone", "CallDone"]
    assert "Beat" not in events  # heartbeats that change nothing are not noted
    declared, fenced_b, fenced_c, promoted = story[-4:]
    assert {"Call(fence -> b)", "Call(fence -> c)"} <= set(declared.actions)
    assert "Call(promote -> c)" in fenced_c.actions and 0 in fenced_c.shards
    assert not any("promote" in a for a in fenced_b.actions)  # c had not answered yet
    assert promoted.stimulus != declared.stimulus


def test_validate_finds_a_broken_invariant(ctl):
    ctl.validate()
    ctl.routing[0] = ["a", "a", "b"]
    with pytest.raises(AssertionError, match="two copies"):
        ctl.validate()


def test_a_backup_lost_and_back_under_its_address_during_a_promotion_is_not_a_copy(ctl):
    """Shard 0 is promoted on c with b as its backup; while the promotion is in flight b's
    worker is lost and a fresh node starts under the same address (holding nothing). The
    promotion's answer must not put b back into the shard's copies by its address (simulation
    seed 77505: the controller called itself healthy with a copy that held none of the shard,
    and a pusher waited for that copy for ever)."""
    for t in (0.5, 1.0, 1.5, 2.0):
        for x in "bc":
            beat(ctl, x, t)
        handle(ctl, Tick(t))
    out = handle(ctl, Tick(2.1))  # a silent: declared dead, b and c fenced
    fences = {c.addr: c for c in of(out, Call) if c.method == "fence"}
    handle(ctl, CallDone(fences["b"].op, {0: (0, 5), 1: (0, 9)}))
    out = handle(ctl, CallDone(fences["c"].op, {0: (0, 7), 1: (0, 9)}))
    promote = next(c for c in of(out, Call) if c.method == "promote" and 0 in c.args[0])
    assert promote.addr == "c" and ("b", "kb") in promote.args[0][0][1]
    t = 2.1
    while "b" in ctl.nodes:  # b goes silent (frozen) and is declared dead
        t += 0.25
        beat(ctl, "c", t)
        handle(ctl, Tick(t))
        assert t < 20
    beat(ctl, "b", t + 0.1)  # it speaks again: its worker may host a new node
    handle(ctl, NodeReady("b", "kb-new", t + 0.2))  # a fresh node, same address
    assert ctl.nodes.get("b") == "kb-new"
    handle(ctl, CallDone(promote.op, {0: 9}))
    assert ctl.routing[0][0] == "c"
    assert "b" not in ctl.routing[0]  # the new b holds none of shard 0 (yet: a copy is added)
