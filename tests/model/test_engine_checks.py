"""Both engines check a step's arguments with one function (model/checks.py): the same bad
arguments are refused by both, with the same one-line error, and nothing is applied."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from adam_dask.errors import InputShapeError, ModelSpecError
from adam_dask.model import Network

SHAPE = (1, 4, 4)

# torch is imported when these tests run (the fixture below), not when the suite is collected
torch: Any = None
TorchNetwork: Any = None


@pytest.fixture(scope="module", autouse=True)
def _torch():
    global torch, TorchNetwork
    import torch  # a test dependency: without it these tests fail, they do not skip

    from adam_dask.model.torch_engine import TorchNetwork


def engines():
    """A numba and a torch network of the same size (103 parameters: 16 -> 5 -> 3)."""
    numba = Network.from_spec("fc5,fc3", SHAPE, "relu", seed=0)
    nn = torch.nn
    module = nn.Sequential(nn.Flatten(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3))
    return [numba, TorchNetwork(module, SHAPE)]


def bad_steps(net, ctx, other_ctx, foreign_ctx):
    """(what is wrong, the arguments of ``net.step_into``) for each bad step."""
    rng = np.random.default_rng(0)
    x = rng.random((8, *SHAPE), dtype=np.float32)
    y = rng.integers(0, 3, 8).astype(np.int64)
    size = net.layout.size
    v1, v = np.zeros(1, np.float32), np.zeros(size, np.float32)
    return [
        ("more images than the context holds", (ctx, x, y, 8, 0.1, 0.0, v1), {}),
        ("more images than given", (ctx, x[:2], y[:2], 3, 0.1, 0.0, v1), {}),
        ("fewer labels than images", (ctx, x[:4], y[:2], None, 0.1, 0.0, v1), {}),
        ("no images", (ctx, x, y, 0, 0.1, 0.0, v1), {}),
        ("momentum without a velocity like flat", (ctx, x, y, 4, 0.1, 0.9, v1), {}),
        ("a context of another network alike", (other_ctx, x, y, 4, 0.1, 0.0, v1), {}),
        ("a context of the other engine", (foreign_ctx, x, y, 4, 0.1, 0.0, v1), {}),
        ("an accumulator too short", (ctx, x, y, 4, 0.1, 0.0, v), {"acc": np.zeros(3, np.float32)}),
        ("an accumulator of float64", (ctx, x, y, 4, 0.1, 0.0, v), {"acc": np.zeros(size)}),
    ]


def test_both_engines_refuse_the_same_bad_steps_with_the_same_one_line():
    numba, torchnet = engines()
    assert numba.layout.size == torchnet.layout.size == 103
    ctxs = {id(numba): numba.context(4), id(torchnet): torchnet.context(4)}
    messages = {}
    for net, foreign in ((numba, torchnet), (torchnet, numba)):
        ctx = ctxs[id(net)]
        other = net.copy()  # same spec or module, another object: its contexts are not net's
        cases = bad_steps(net, ctx, other.context(4), ctxs[id(foreign)])
        before = net.flat.copy()
        for what, args, kw in cases:
            with pytest.raises(InputShapeError) as info:
                net.step_into(*args, **kw)
            line = str(info.value)
            assert "\n" not in line, what
            for c in (args[0],):  # the message names the context; the rest is the engines'
                line = line.replace(repr(c), "<context>")
            messages.setdefault(what, set()).add(line)
        np.testing.assert_array_equal(net.flat, before)  # nothing was applied
        x = np.random.default_rng(1).random((4, *SHAPE), dtype=np.float32)
        net.step_into(ctx, x, np.zeros(4, np.int64), 4, 0.1, 0.0, np.zeros(1, np.float32))
        assert not np.array_equal(net.flat, before)  # and a valid step still works afterwards
    for what, lines in messages.items():
        assert len(lines) == 1, f"{what}: the engines say {lines}"
    assert "another network" in messages["a context of the other engine"].pop()
    assert "velocity of 103 values" in messages["momentum without a velocity like flat"].pop()
    assert "accumulator" in messages["an accumulator of float64"].pop()


def test_the_dense_offload_is_the_numba_engines_only():
    numba, torchnet = engines()
    x = np.random.default_rng(2).random((4, *SHAPE), dtype=np.float32)
    y = np.zeros(4, np.int64)
    terms: dict = {}
    numba.step_into(numba.context(4), x, y, 4, 0.1, 0.0, np.zeros(1, np.float32), dense_terms=terms)
    assert sorted(terms) == ["0", "1"]
    with pytest.raises(ModelSpecError, match="needs the numba engine"):
        torchnet.step_into(
            torchnet.context(4), x, y, 4, 0.1, 0.0, np.zeros(1, np.float32), dense_terms={}
        )


def test_both_engines_share_repr_and_flat():
    numba, torchnet = engines()
    assert (
        repr(numba)
        == "Network('fc5,fc3', input_shape=(1, 4, 4), activation='relu', 103 parameters)"
    )
    assert repr(torchnet).startswith("TorchNetwork('torch:torch.nn.modules.container.Sequential'")
    assert repr(torchnet).endswith("input_shape=(1, 4, 4), 103 parameters)")
    values = np.arange(103, dtype=np.float32)
    for net in (numba, torchnet):
        view = net.parameters[next(iter(net.parameters))]
        net.flat = values  # copies in: the parameters' views stay valid
        np.testing.assert_array_equal(net.flat, values)
        assert np.shares_memory(view, net.flat)
        with pytest.raises(InputShapeError, match="expected 103 parameter values"):
            net.flat = values[:5]
    assert numba.population == {} and torchnet.calibrated is False  # old statistics dropped
