"""``adam_dask.load(url)``: a checkpoint read back into the network that trained it, for either
engine, without a cluster; and the model package reads checkpoints without importing the
parameter server."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import adam_dask
from adam_dask.errors import CheckpointError, ModelSpecError
from adam_dask.model.layout import shard_ranges
from adam_dask.model.network import Network
from adam_dask.ps.checkpoint import init_checkpoint

SHARD_BYTES = 1 << 12


def write(url: str, net, **meta) -> None:
    """A checkpoint of ``net`` as a run writes it: its values and its description in the meta."""
    size = net.flat.size
    init_checkpoint(
        url,
        None,
        size=size,
        shard_bytes=SHARD_BYTES,
        shards=shard_ranges(size, SHARD_BYTES),
        values=net.flat,
        epoch=3,
        meta={"model": net.to_dict(), **meta},
        layout=net.layout.to_dict(),
    )


def test_load_gives_back_a_numba_network_with_the_checkpoints_weights(tmp_path):
    trained = Network.from_spec("conv5x5:4,maxpool2,fc16,fc10", input_shape=(1, 28, 28), seed=3)
    trained.flat[:] = np.random.default_rng(0).normal(0, 0.1, trained.flat.size)
    url = str(tmp_path / "run")
    write(url, trained)
    net = adam_dask.load(url)
    assert isinstance(net, Network) and net.spec == trained.spec
    np.testing.assert_array_equal(net.flat, trained.flat)
    x = np.random.default_rng(1).random((5, 1, 28, 28), dtype=np.float32)
    np.testing.assert_allclose(net.forward(x), trained.forward(x), rtol=1e-5)
    assert "load" in adam_dask.__all__
    # the classmethod the torch engine has, on the numba engine too
    np.testing.assert_array_equal(Network.from_checkpoint(url).flat, trained.flat)


def test_load_gives_back_a_torch_module_with_the_checkpoints_weights(tmp_path):
    torch = pytest.importorskip("torch")
    from adam_dask.model.torch_engine import TorchNetwork

    factory = "adam_dask.model.torch_examples:tiny_residual_net"
    trained = TorchNetwork.build(factory, (1, 28, 28), seed=1)
    trained.flat[:] = np.random.default_rng(0).normal(0, 0.05, trained.flat.size)
    url = str(tmp_path / "run")
    write(url, trained)
    net = adam_dask.load(url)
    assert isinstance(net, TorchNetwork) and net.factory == factory
    np.testing.assert_array_equal(net.flat, trained.flat)
    state = net.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    # a numba checkpoint is not a torch one: one error, naming what to call instead
    other = str(tmp_path / "numba")
    write(other, Network.from_spec("fc10", input_shape=(1, 28, 28)))
    with pytest.raises(ModelSpecError, match=r"adam_dask\.load"):
        TorchNetwork.from_checkpoint(other)


def test_load_of_no_checkpoint_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        adam_dask.load(str(tmp_path / "nothing"))
    url = str(tmp_path / "bare")
    net = Network.from_spec("fc10", input_shape=(1, 28, 28))
    size = net.flat.size
    init_checkpoint(
        url, None, size=size, shard_bytes=SHARD_BYTES, shards=shard_ranges(size, SHARD_BYTES)
    )
    with pytest.raises(CheckpointError, match="names no model"):
        adam_dask.load(url)


def test_the_model_package_does_not_import_the_parameter_server():
    """model/ sits below ps/ (the server shards a model's flat buffer): reading a checkpoint
    back into a model must not make an arrow back up."""
    root = Path(adam_dask.__file__).parent
    offenders = []
    for path in sorted((root / "model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                if mod.startswith("..ps") or mod.startswith("adam_dask.ps"):
                    offenders.append(f"{path.name}: {mod}")
            elif isinstance(node, ast.Import):
                offenders += [
                    f"{path.name}: {a.name}"
                    for a in node.names
                    if a.name.startswith("adam_dask.ps")
                ]
    assert offenders == []
