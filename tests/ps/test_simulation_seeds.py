"""The schedules of the PS simulation (adam_dask.testing.simulation) that once never healed, one
test each, and the rule each one broke, as a pure-state test.

Each seed test replays a schedule that meets the situation, checks it still does (else it
would prove nothing), and that the protocol heals within the simulation's bound and keeps
every invariant. A schedule depends on every choice the seed makes, the pushers' included, so
the seeds are those that meet each situation with the simulation as it is (its pushers running
the client's Delivery, Routing and ReplayLog); the seeds that stalled are named in each rule's
test.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from adam_dask.ps.protocol.messages import (
    AddBackups,
    Assign,
    Fence,
    Forward,
    ForwardDone,
    ForwardDue,
    Promote,
    Push,
    Pushes,
    Reply,
    WriteBlocks,
    WriteDone,
    WriteDue,
)
from adam_dask.ps.protocol.node_machine import handle
from adam_dask.ps.protocol.node_state import NodeState
from adam_dask.testing.simulation import HEAL_BOUND, simulate

STILL_PRIMARY = "still its primary"


def heals(seed, capsys, caplog):
    """Run ``seed`` with its trace; return (summary, trace, log text)."""
    with caplog.at_level(logging.INFO, logger="adam_dask.ps"):
        r = simulate(seed, trace=True)
    assert r["healed_after"] <= HEAL_BOUND
    return r, capsys.readouterr().out, caplog.text


# -- a re-promoted primary and the refusal of its old block -----------------------------------


def test_a_primary_promoted_again_keeps_its_shard_when_its_older_block_is_refused():
    """The rule seeds 1211, 7089, 8769, 9284, 15909 and 19452 of an earlier schedule broke, on
    one node: primary at generation 2, it writes a block; the controller's answer to its
    promotion was lost, so the controller fenced it (generation 5) and promoted it again. The refusal of the generation-2
    block names generation 5, its own now: it stays the primary. A refusal of a block of its
    current generation, or naming a newer one, still deposes it."""
    n = 4
    ns = NodeState("p", dedup_window=16, checkpoint=True)
    handle(ns, Assign("a", {0: (0, n)}, {0: 2}, {0: []}))
    handle(ns, Pushes((Push("x", {0: np.ones(n, np.float32)}, 1, {0: 2}, "replay"),)))
    (old,) = [a for a in handle(ns, WriteDue()) if isinstance(a, WriteBlocks)]
    assert old.snaps[0].gen == 2
    handle(ns, Fence("f", {0: 5}))
    assert 0 not in ns.primaries
    handle(ns, Promote("p", {0: (5, [])}))
    handle(ns, WriteDone({}, {0: 5}))  # the old block's refusal arrives now
    assert 0 in ns.primaries and ns.stepped_down == 1  # only the fence stepped it down
    (new,) = [a for a in handle(ns, WriteDue()) if isinstance(a, WriteBlocks)]
    assert new.snaps[0].gen == 5
    handle(ns, WriteDone({}, {0: 5}))  # its generation-5 block refused: not its primary
    assert 0 not in ns.primaries

    other = NodeState("q", dedup_window=16, checkpoint=True)
    handle(other, Assign("a", {0: (0, n)}, {0: 5}, {0: []}))
    handle(other, Pushes((Push("x", {0: np.ones(n, np.float32)}, 1, {0: 5}, "replay"),)))
    handle(other, WriteDue())
    handle(other, WriteDone({}, {0: 7}))  # a newer generation exists
    assert 0 not in other.primaries


LOST_ANSWER = [
    (
        212,
        "a storage outage while w1 and w3 are frozen and declared dead; a controller call's "
        "answer is lost, and a primary promoted again meets the refusal of its older block",
    ),
    (
        330,
        "w1 frozen for six seconds and declared dead; a controller call's answer is lost, and "
        "a primary promoted again meets the refusal of its older block",
    ),
]


@pytest.mark.parametrize("seed, story", LOST_ANSWER, ids=[f"seed_{s}" for s, _ in LOST_ANSWER])
def test_seed_heals_after_a_lost_promotion_answer(seed, story, capsys, caplog):
    """Each schedule (``story``) meets the rule above: the refusal of the block a primary
    wrote before its re-promotion (which deposed it, and the routing named for good a node that
    refused every push and every new backup: 'did not settle in 6000 steps', seeds 1211, 7089,
    8769, 9284, 15909 and 19452 of an earlier schedule). It keeps its shard and every shard
    heals."""
    _, trace, logs = heals(seed, capsys, caplog)
    assert "answered: OSError('connection lost')" in trace
    assert STILL_PRIMARY in logs  # the schedule still meets the old block's refusal


# -- a node created on a frozen worker --------------------------------------------------------


FROZEN_CREATE = [
    (
        184,
        "one shard; w1 frozen, w2 crashes, w1 freezes again while the controller creates a "
        "node there, which starts when it wakes",
    ),
    (
        306,
        "w3 crashes, w1 freezes twice; the node the controller creates on w1 starts when it "
        "wakes, six seconds later",
    ),
]


@pytest.mark.parametrize("seed, story", FROZEN_CREATE, ids=[f"seed_{s}" for s, _ in FROZEN_CREATE])
def test_seed_heals_when_a_node_is_created_on_a_frozen_worker(seed, story, capsys, caplog):
    """Each schedule (``story``) creates a node on a frozen worker. The simulated scheduler
    once dropped such a creation without an answer, and the controller waited for it forever
    (seeds 9012 and 9893 of an earlier schedule; the plugin gives up after the call timeout and
    reports NodeFailed: the simulation was wrong, not the controller). The actor starts when
    the worker wakes, as Dask's would, and the shards heal."""
    _, trace, _ = heals(seed, capsys, caplog)
    assert "waits: the worker is frozen" in trace
    assert "node ready" in trace


# -- a backup's worker hosts a new node -------------------------------------------------------


def test_a_new_node_on_a_backups_worker_is_sent_everything():
    """The rule two seeds of an earlier schedule broke (42091, 97005), on one node: the primary knew what its backup on
    worker "b" held (node k1). That node was lost and "b" came back with a new, empty node
    (k2), which the controller added as the backup. The primary took k1's position for k2's
    and sent it nothing: the new copy stayed empty and the shard never converged."""
    n = 4
    ns = NodeState("p", dedup_window=16, checkpoint=True)
    handle(ns, Assign("a", {0: (0, n)}, {0: 3}, {0: [("b", "k1")]}))
    handle(ns, Pushes((Push("x", {0: np.ones(n, np.float32)}, 1, {0: 3}, "replay"),)))
    (fwd,) = [a for a in handle(ns, ForwardDue()) if isinstance(a, Forward)]
    out = handle(ns, AddBackups("add", {0: [("b", "k2")]}, 5))  # k1's answer still on its way
    handle(ns, ForwardDone("b", {0: (3, 1)}, {}))  # k1's answer: nothing about k2
    out += handle(ns, ForwardDue())
    (again,) = [a for a in out if isinstance(a, Forward)]
    assert fwd.key == "k1" and again.key == "k2"
    assert again.snaps[0].full  # everything: k2 holds nothing yet


def test_an_add_asked_again_answers_only_once_the_added_backup_holds_the_shard():
    """The rule seed 41688 broke (the 100,000-seed sweep at dc3c58f), on one node: the
    controller's add of backup "b" reached the primary twice (a copy of the request; a retry
    after a lost answer is the same). The second found "b" listed already, waited for no
    backup and answered at once: the controller counted "b", still empty, as a copy, and when
    the primary died the pushes it had acknowledged were lost. Both answers now wait until "b"
    holds the shard's position."""
    n = 4
    ns = NodeState("p", dedup_window=16, checkpoint=True)
    handle(ns, Assign("a", {0: (0, n)}, {0: 2}, {0: []}))
    handle(ns, Pushes((Push("x", {0: np.ones(n, np.float32)}, 1, {0: 2}, "replay"),)))
    first = handle(ns, AddBackups("add", {0: [("b", "k1")]}, 5))
    again = handle(ns, AddBackups("add", {0: [("b", "k1")]}, 5))
    (fwd,) = [a for a in first + again if isinstance(a, Forward)]
    assert not [a for a in first + again if isinstance(a, Reply)]  # "b" holds nothing yet
    done = handle(ns, ForwardDone("b", {0: (2, 1)}, {}))
    assert [a.value for a in done if isinstance(a, Reply)] == [{0: 1}, {0: 1}]
    assert fwd.snaps[0].full


def test_the_late_answer_of_a_backups_old_node_does_not_fill_its_new_one():
    """Backup "b" was node k1; its worker now hosts k2, which an add lists. k1's answer to a
    forward sent before (its cancel came too late) names the position k1 held: counted for
    k2, the add answered while k2 held nothing. An answer names the node it came from, and
    only the listed one's counts."""
    n = 4
    ns = NodeState("p", dedup_window=16, checkpoint=True)
    handle(ns, Assign("a", {0: (0, n)}, {0: 3}, {0: [("b", "k1")]}))
    handle(ns, Pushes((Push("x", {0: np.ones(n, np.float32)}, 1, {0: 3}, "replay"),)))
    handle(ns, ForwardDue())
    out = handle(ns, AddBackups("add", {0: [("b", "k2")]}, 5))
    out += handle(ns, ForwardDone("b", {0: (3, 1)}, {}, "k1"))  # k1's answer, late
    out += handle(ns, ForwardDue())
    assert not [a for a in out if isinstance(a, Reply)]
    fwds = [a for a in out if isinstance(a, Forward)]
    assert fwds and all(f.key == "k2" and f.snaps[0].full for f in fwds)
    done = handle(ns, ForwardDone("b", {0: (3, 1)}, {}, "k2"))
    assert [a.value for a in done if isinstance(a, Reply)] == [{0: 1}]


NEW_NODE = [
    (
        177,
        "w1, w2 and w3 crash at once; the new w5 freezes, is declared dead, speaks again and "
        "gets a new node",
    ),
    (
        442,
        "w4 and w3 freeze, w2 crashes; the new w5 freezes for three seconds, is declared dead "
        "and gets a new node when it wakes",
    ),
]


@pytest.mark.parametrize("seed, story", NEW_NODE, ids=[f"seed_{s}" for s, _ in NEW_NODE])
def test_seed_heals_when_a_backups_worker_gets_a_new_node(seed, story, capsys, caplog):
    """Each schedule (``story``) gives a worker a second node. The primary once kept the
    position the lost node had reported, sent the new one nothing, and the new copy stayed
    empty while the controller counted it ('did not settle in 20000 steps'). The primary sends
    the new node everything and the copies converge."""
    _, trace, _ = heals(seed, capsys, caplog)
    ready = re.findall(r"node ready (w\d+) ", trace)
    assert len(ready) > len(set(ready))  # some worker got a second node


# -- a backup added but never filled, then every filled copy lost --------------------------------


def test_seed_55436_fills_the_backup_its_copied_add_lists_before_it_counts(capsys, caplog):
    """Seed 55436 (a 100,000-seed sweep's one failure, before seed 41688's rule): the add of
    backup w4 reached the primary twice; the copy found w4 listed and answered at once, so the
    controller counted w4, still empty, as a copy; then the primary and the other backup
    crashed and the empty survivor was all there was. The controller's rule for such a
    survivor (never promoted: the shard is rebuilt from the checkpoint,
    :func:`test_controller.test_survivors_never_filled_are_not_promoted_the_shard_is_restored`)
    stays; with the add's rule above w4 holds the shard before it counts, the schedule meets
    no empty survivor and heals with nothing acknowledged lost."""
    r, trace, log = heals(55436, capsys, caplog)
    add = trace.index("add_backups on w1 ({0: [('w2', 'key-w2-2'), ('w4', 'key-w4-4')]}")
    assert re.match(r"\s+[\d.]+\s+duplicate request #\d+ -> w1", trace[add:].split("\n")[1])
    assert "never filled" not in log
    assert r["acknowledged_lost"] == 0


@pytest.mark.parametrize("seed", [9680, 17706])
@pytest.mark.parametrize("optimizer", [None, {"kind": "nesterov", "lr": 0.2, "momentum": 0.9}])
def test_a_backup_on_a_new_node_is_sent_every_push_id(seed, optimizer):
    """A backup's worker hosts a new node; the primary's record of it still held the old
    node's position (a late answer), so its forward named only the push ids past that
    position: the new copy had the values of 4 pushes and the id of 1, and promoted it would
    have applied a retried push again. The copy now refuses a forward whose ids start past
    what it holds (``ShardCopy.gap``) and the primary starts it over with a whole copy. Found
    by the 100,000-seed sweep once the simulation checked that a copy's values and its push
    ids name the same pushes."""
    assert simulate(seed, optimizer=optimizer)["pushes"] > 0
