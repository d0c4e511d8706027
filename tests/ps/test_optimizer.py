"""The server optimizer (adam_dask.ps.protocol.optimizer), pure: its kernel against a numpy
reference, ``sum`` bit for bit the sum, staleness, the momentum as shard state (copied,
installed, stored in a checkpoint block), and the sign of a Nesterov step on a real network."""

from __future__ import annotations

import numpy as np
import pytest

from adam_dask.errors import ConfigError
from adam_dask.ps.protocol.messages import Push, Pushes, Replicate
from adam_dask.ps.protocol.node_data import forwards
from adam_dask.ps.protocol.node_machine import handle
from adam_dask.ps.protocol.node_state import NodeState
from adam_dask.ps.protocol.optimizer import ServerOptimizer, staleness_scale
from adam_dask.ps.protocol.shard import ShardState
from adam_dask.ps.protocol.shard_kernels import nesterov_step

N = 1037  # not a multiple of a SIMD width
NESTEROV = ServerOptimizer("nesterov", 0.7, 0.9)


def deltas(k: int, seed: int = 0, n: int = N) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1e-2, n).astype(np.float32) for _ in range(k)]


def nesterov_reference(values, momentum, delta, lr, mu, s):
    """numpy, float32 throughout, the kernel's order of operations."""
    f = np.float32
    g = f(s) * delta
    momentum[:] = f(mu) * momentum + g
    values += f(lr) * (g + f(mu) * momentum)


def test_nesterov_kernel_matches_numpy():
    rng = np.random.default_rng(1)
    v = rng.normal(0, 1, N).astype(np.float32)
    m = rng.normal(0, 1e-2, N).astype(np.float32)
    rv, rm = v.copy(), m.copy()
    for d, s in zip(deltas(5), [1.0, 0.5, 1.0, 0.25, 1.0 / 3]):
        nesterov_step(v, m, d, 0.7, 0.9, s)
        nesterov_reference(rv, rm, d, 0.7, 0.9, s)
    np.testing.assert_allclose(v, rv, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m, rm, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(v, rng.normal(0, 1, N))  # it moved


def test_sum_is_the_sum_bit_for_bit():
    """``sum`` (the default, and named) adds each delta in push order, as Adam's server did:
    the same bits as numpy's ``values += d`` one push at a time; ``nesterov`` with rate 1 and
    momentum 0 reduces to it exactly."""
    ds = deltas(19, seed=2)
    init = np.random.default_rng(3).normal(0, 1, N).astype(np.float32)
    ref = init.copy()
    for d in ds:
        ref += d
    shards = [
        ShardState(0, 0, N, init),
        ShardState(0, 0, N, init, optimizer=ServerOptimizer.resolve("sum")),
        ShardState(0, 0, N, init, optimizer=ServerOptimizer("nesterov", 1.0, 0.0)),
    ]
    for st in shards:
        st.apply_batch(ds[:11], list(range(11)))
        st.apply_batch(ds[11:], list(range(11, 19)))
        assert st.values.tobytes() == ref.tobytes()
        assert st.version == 19
    assert shards[0].state is None and shards[1].state is None  # the sum keeps no state


def test_nesterov_applies_each_push_once_in_order():
    ds = deltas(6, seed=4)
    st = ShardState(0, 0, N, optimizer=NESTEROV)
    st.apply_batch(ds[:4], [10, 11, 12, 13])
    st.apply_batch(ds[2:], [12, 13, 14, 15])  # 12 and 13 retried: applied once
    v, m = np.zeros(N, np.float32), np.zeros(N, np.float32)
    for d in ds:
        nesterov_step(v, m, d, 0.7, 0.9, 1.0)
    assert st.version == 6
    assert st.values.tobytes() == v.tobytes() and st.state is not None
    assert st.state.tobytes() == m.tobytes()
    # the order matters now: the pushes in another order give other values
    v2, m2 = np.zeros(N, np.float32), np.zeros(N, np.float32)
    for d in reversed(ds):
        nesterov_step(v2, m2, d, 0.7, 0.9, 1.0)
    assert v2.tobytes() != v.tobytes()


def test_staleness_scales_by_the_versions_moved_since_the_read():
    assert staleness_scale(None) == 1.0 and staleness_scale(0) == 1.0
    assert staleness_scale(3) == 0.25
    d = np.ones(N, np.float32)
    st = ShardState(0, 0, N, optimizer=ServerOptimizer.resolve("sum+staleness"))
    st.apply(d, 1, base=0)  # read at 0, applied at 0: not stale
    st.apply(d, 2)  # no read named: not scaled
    st.apply(d, 3, base=1)  # read at 1, applied at 2: 1 version moved
    st.apply(d, 4, base=0)  # 3 versions moved
    assert st.values[0] == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert st.state is None  # a scaled sum keeps no momentum
    # without staleness the versions a pusher names change nothing
    for opt in (ServerOptimizer.resolve("sum"), NESTEROV):
        plain, named = ShardState(0, 0, N, optimizer=opt), ShardState(0, 0, N, optimizer=opt)
        for i, dd in enumerate(deltas(4, seed=9)):
            plain.apply(dd, i)
            named.apply(dd, i, base=0)
        assert plain.values.tobytes() == named.values.tobytes()


def test_names_and_bad_names():
    assert ServerOptimizer.resolve().name == "sum"  # the default (adam.ps.optimizer)
    opt = ServerOptimizer.resolve("Nesterov+staleness", lr=0.5, momentum=0.8)
    assert (opt.kind, opt.lr, opt.momentum, opt.staleness) == ("nesterov", 0.5, 0.8, True)
    assert ServerOptimizer.from_dict(opt.to_dict()) == opt
    with pytest.raises(ConfigError, match="not one of"):
        ServerOptimizer.resolve("adamw")
    with pytest.raises(ConfigError, match="unknown option"):
        ServerOptimizer.resolve("nesterov+stale")
    with pytest.raises(ConfigError, match="momentum"):
        ServerOptimizer("nesterov", 0.7, 1.0)


def test_momentum_is_copied_and_a_promoted_copy_continues_exactly():
    """A backup installs the primary's values and momentum at a version; promoted, it applies
    the next pushes to the same bits as the primary it replaces would have."""
    ds = deltas(8, seed=5)
    primary = ShardState(0, 0, N, optimizer=NESTEROV)
    backup = ShardState(0, 0, N, optimizer=NESTEROV)
    primary.apply_batch(ds[:5], list(range(5)))
    assert backup.install(*_copy_args(primary))
    assert backup.state is not None and primary.state is not None
    assert backup.state.tobytes() == primary.state.tobytes()
    primary.apply_batch(ds[5:], list(range(5, 8)))
    backup.gen += 1  # promoted
    backup.apply_batch(ds[5:], list(range(5, 8)))
    assert backup.values.tobytes() == primary.values.tobytes()
    assert backup.state.tobytes() == primary.state.tobytes()


def _copy_args(st: ShardState) -> tuple:
    snap = st.snapshot()
    return (snap.version, snap.values, snap.ids, snap.gen, snap.full, snap.marks, snap.state)


def test_node_forwards_momentum_and_applies_bases():
    """Through the node's state machine: a push naming the version its pusher read is scaled,
    and the forward to a backup carries the momentum, which the backup installs."""
    opt = ServerOptimizer("nesterov", 0.7, 0.9, staleness=True)
    node = NodeState("tcp://a", optimizer=opt)
    st = ShardState(0, 0, N, optimizer=opt)
    node.shards[0], node.gens[0], node.primaries[0] = st, 0, [("tcp://b", "k")]
    ds = deltas(3, seed=6)
    items = tuple(
        Push(None, {0: d}, 100 + i, {0: 0}, "primary", None, False, {0: 0})
        for i, d in enumerate(ds)
    )
    handle(node, Pushes(items))
    v, m = np.zeros(N, np.float32), np.zeros(N, np.float32)
    for i, d in enumerate(ds):  # all read version 0: 0, 1 and 2 versions stale
        nesterov_step(v, m, d, 0.7, 0.9, 1.0 / (1 + i))
    assert st.values.tobytes() == v.tobytes()
    (forward,) = [a for a in forwards(node) if a.addr == "tcp://b"]
    (snap,) = forward.snaps
    assert snap.state is not None and snap.state.tobytes() == m.tobytes()
    backup = NodeState("tcp://b", optimizer=opt)
    backup.shards[0], backup.gens[0] = ShardState(0, 0, N, optimizer=opt), 0
    handle(backup, Replicate(None, "tcp://a", forward.snaps))
    assert backup.shards[0].state.tobytes() == m.tobytes()
    assert backup.shards[0].values.tobytes() == v.tobytes()


def test_checkpoint_block_holds_the_momentum(tmp_path):
    from adam_dask.ps.checkpoint import BlockStore, split_block

    st = ShardState(3, 100, 100 + N, optimizer=NESTEROV)
    st.apply_batch(deltas(3, seed=7), [1, 2, 3])
    store = BlockStore(f"file://{tmp_path}/ckpt")
    path = store.write(st.snapshot())
    block, attrs, ids = store.read(path)
    values, state = split_block(block, attrs)
    assert values.tobytes() == st.values.tobytes()
    assert state is not None and st.state is not None
    assert state.tobytes() == st.state.tobytes()
    assert [p for _, p in ids] == [1, 2, 3]
    plain = ShardState(4, 0, N)
    plain.apply(deltas(1)[0], 9)
    block, attrs, _ = store.read(store.write(plain.snapshot()))
    assert split_block(block, attrs)[1] is None and block.shape == (N,)


def test_one_nesterov_step_lowers_the_training_loss():
    """The sign: a replica's delta (its weights' move, the negative of DiLoCo's
    pseudo-gradient) through a fresh server momentum lowers the loss of the batch it came
    from (a wrong sign would raise it)."""
    from adam_dask.model.network import Network
    from adam_dask.testing import synthetic_digits

    net = Network.from_spec("conv5x5:4,maxpool2,fc32,fc10", input_shape=(1, 28, 28), seed=0)
    x, y = synthetic_digits(64, seed=1)
    x = (x.astype(np.float32) / 255.0)[:, None]
    flat0 = net.flat.copy()
    loss0, grad = net.loss_and_gradient(x, y)
    delta = (-0.05 * grad).astype(np.float32)  # what a replica would push after one step
    st = ShardState(0, 0, flat0.shape[0], flat0, optimizer=NESTEROV)
    st.apply(delta, 1)
    net.flat[:] = st.values
    loss1, _ = net.loss_and_gradient(x, y)
    assert loss1 < loss0
    # and the step is the one the module doc names: lr (1 + mu) d from zero momentum
    np.testing.assert_allclose(st.values - flat0, 0.7 * 1.9 * delta, rtol=1e-4, atol=1e-6)


# -- synchronous rounds: DiLoCo's outer step, exactly ---------------------------------------------


def _share(epoch: int, replica: int, seq: int, *, sync: bool = True, part: int = 0, parts=1):
    from adam_dask.ps.protocol.mark import Mark

    return Mark(epoch, replica, seq, part, parts, 3, {"r": replica}, synchronous=sync)


def diloco_reference(values, momentum, rounds, lr, mu):
    """numpy, float64: per round of shares ``D = sum``, ``m = mu m + D``, ``w += lr (D + mu m)``."""
    w, m = values.astype(np.float64), momentum.astype(np.float64)
    for shares in rounds:
        total = np.sum([d.astype(np.float64) for d in shares], axis=0)
        m = mu * m + total
        w = w + lr * (total + mu * m)
    return w, m


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_a_synchronous_round_is_one_nesterov_step_on_its_shares_in_any_order(order):
    """The shares of one synchronous step (marks with the same epoch and seq) are DiLoCo's one
    outer step on their sum, whichever arrives first; the same pushes without the synchronous
    mark are three steps (the momentum decays per push) and end elsewhere."""
    rounds = [deltas(3, seed=20), deltas(3, seed=21)]
    st = ShardState(0, 0, N, optimizer=NESTEROV)
    pid = 0
    for seq, shares in enumerate(rounds):
        for r in order:
            pid += 1
            st.apply(shares[r], pid, _share(0, r, seq), base=0)
    w, m = diloco_reference(np.zeros(N, np.float32), np.zeros(N, np.float32), rounds, 0.7, 0.9)
    np.testing.assert_allclose(st.values, w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(st.state, m, rtol=1e-5, atol=1e-7)
    per_push = ShardState(0, 0, N, optimizer=NESTEROV)
    for seq, shares in enumerate(rounds):
        for r in order:
            per_push.apply(shares[r], mark=_share(0, r, seq, sync=False))
    assert np.abs(per_push.values - w).max() > 100 * np.abs(st.values - w).max()


def test_parts_of_a_share_join_its_round_and_staleness_leaves_a_round_alone():
    """A share sent as two parts (a delta, then the dense layers' outer products) decays the
    momentum once; with +staleness, a round's later shares are not scaled though the shard
    moved since their pushers read it (they all read the round's start)."""
    opt = ServerOptimizer("nesterov", 0.7, 0.9, staleness=True)
    a, b, c = deltas(3, seed=22)
    st = ShardState(0, 0, N, optimizer=opt)
    st.apply(a, 1, _share(0, 0, 0, part=0, parts=2), base=0)
    st.apply(b, 2, _share(0, 0, 0, part=1, parts=2), base=0)
    st.apply(c, 3, _share(0, 1, 0), base=0)
    w, m = diloco_reference(np.zeros(N, np.float32), np.zeros(N, np.float32), [[a, b, c]], 0.7, 0.9)
    np.testing.assert_allclose(st.values, w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(st.state, m, rtol=1e-5, atol=1e-7)
    assert st.joins_round(_share(0, 2, 0)) and not st.joins_round(_share(0, 2, 1))
    assert not st.joins_round(_share(0, 2, 0, sync=False))


def test_a_copy_promoted_mid_round_continues_the_round(tmp_path):
    """A backup that installed the primary's copy after the round's first share (values,
    momentum and marks) applies the next share as a joining one: bit for bit the primary's
    result; so does a shard read back from a checkpoint block (its marks set)."""
    shares = deltas(2, seed=23)
    primary = ShardState(0, 0, N, optimizer=NESTEROV)
    primary.apply(shares[0], 1, _share(0, 0, 5))
    copy = primary.snapshot()
    primary.apply(shares[1], 2, _share(0, 1, 5))
    backup = ShardState(0, 0, N, optimizer=NESTEROV)
    assert backup.install(
        copy.version, copy.values, copy.ids, copy.gen, True, copy.marks, copy.state
    )
    backup.apply(shares[1], 2, _share(0, 1, 5))
    assert backup.values.tobytes() == primary.values.tobytes()
    assert backup.state.tobytes() == primary.state.tobytes()
    # the same from a checkpoint block: its marks keep the flag
    from adam_dask.ps.checkpoint import BlockStore, block_marks, split_block

    store = BlockStore(f"file://{tmp_path}/ckpt")
    block, attrs, ids = store.read(store.write(copy))
    values, state = split_block(block, attrs)
    restored = ShardState(0, 0, N, optimizer=NESTEROV)
    restored.install(copy.version, values, ids, copy.gen, True, block_marks(attrs), state)
    restored.apply(shares[1], 2, _share(0, 1, 5))
    assert restored.values.tobytes() == primary.values.tobytes()
    # without the marks the backup would open a second round: another result
    blind = ShardState(0, 0, N, optimizer=NESTEROV)
    blind.install(copy.version, copy.values, copy.ids, copy.gen, True, (), copy.state)
    blind.apply(shares[1], 2, _share(0, 1, 5))
    assert blind.values.tobytes() != primary.values.tobytes()


def test_a_mark_keeps_its_synchronous_flag_on_the_wire():
    from adam_dask.ps.protocol.mark import Mark
    from adam_dask.train._position import Marker

    m = _share(3, 1, 7)
    assert Mark.from_json(m.to_json()) == m and m.round == (3, 7)
    old = m.to_json()[:8]  # a mark written before the flag: a push of its own
    assert Mark.from_json(old).synchronous is False and Mark.from_json(old).round is None
    marks = Marker(2, 0, 2, synchronous=True).marks({(0, 0): 8}, 2)
    assert [mk.round for mk in marks] == [(2, 0), (2, 0)]
    assert Marker(2, 0, 2).marks({(0, 0): 8}, 1)[0].round is None
