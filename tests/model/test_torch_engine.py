"""The torch engine in one process: a step equals PyTorch's SGD step, parameters are views of the
flat buffer, Hogwild threads learn, batch norm is recalibrated, bad models give one clear error."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from adam_dask.errors import ModelSpecError
from adam_dask.model.engines import is_factory_path, is_torch_model, network_from_dict
from adam_dask.testing import synthetic_digits
from adam_dask.train.replica import HogwildReplica

SHAPE = (1, 12, 12)

# torch and what needs it, imported when these tests run (the fixture below), not when the
# suite is collected: an import at collection would put torch into every other test's process
torch: Any = None
nn: Any = None
TorchNetwork: Any = None
ResidualNet: Any = None
tiny_residual_net: Any = None
Padded: Any = None


@pytest.fixture(scope="module", autouse=True)
def _torch():
    global torch, nn, TorchNetwork, ResidualNet, tiny_residual_net, Padded
    import torch  # a test dependency: without it these tests fail, they do not skip

    nn = torch.nn
    from adam_dask.model.torch_engine import TorchNetwork
    from adam_dask.model.torch_examples import ResidualNet, tiny_residual_net

    class Padded(nn.Module):
        """Padding, a stride and a residual connection, no batch norm (a deterministic step)."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.down = nn.Conv2d(4, 6, 3, stride=2, padding=1)
            self.res = nn.Conv2d(6, 6, 3, padding=1)
            self.fc = nn.Linear(6 * 6 * 6, 3)

        def forward(self, x):
            x = torch.tanh(self.conv(x))
            x = torch.tanh(self.down(x))
            x = x + torch.tanh(self.res(x))
            return self.fc(x.flatten(1))


def batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, *SHAPE), dtype=np.float32), rng.integers(0, 3, n).astype(np.int64)


def flat_of(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_step_equals_pytorch_sgd_on_the_same_mini_batch(momentum):
    torch.manual_seed(0)
    ref = Padded()
    net = TorchNetwork(copy.deepcopy(ref), SHAPE)
    np.testing.assert_array_equal(net.flat, flat_of(ref))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    ctx = net.context(8)
    vel = np.zeros(net.layout.size if momentum else 1, np.float32)
    acc = net.layout.allocate()
    before = net.flat.copy()
    for step in range(3):  # momentum carries over steps
        x, y = batch(seed=step)
        opt.zero_grad()
        want = nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y))
        want.backward()
        opt.step()
        loss = net.step_into(ctx, x, y, 8, 0.1, momentum, vel, acc=acc)
        assert loss == pytest.approx(float(want.detach()), rel=1e-5)
        np.testing.assert_allclose(net.flat, flat_of(ref), rtol=1e-5, atol=1e-6)
    # the accumulator holds exactly the updates made, and the gradient buffer is left zero
    np.testing.assert_allclose(acc, net.flat - before, atol=1e-6)
    assert not ctx.grad.any()


def test_the_users_loss_is_stepped_and_travels_with_the_job():
    def smoothed(logits, labels):
        return nn.functional.cross_entropy(logits, labels, label_smoothing=0.2)

    torch.manual_seed(0)
    ref = Padded()
    net = TorchNetwork(copy.deepcopy(ref), SHAPE, loss=smoothed)
    x, y = batch()
    want = smoothed(ref(torch.from_numpy(x)), torch.from_numpy(y))
    want.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    loss = net.step_into(net.context(8), x, y, 8, 0.1, 0.0, np.zeros(1, np.float32))
    assert loss == pytest.approx(float(want.detach()), rel=1e-5)
    np.testing.assert_allclose(net.flat, flat_of(ref), rtol=1e-5, atol=1e-6)
    # a worker rebuilds it with the same loss; the manifest's description names it only
    assert net.to_dict()["loss"].endswith("smoothed") and "loss_pickle" not in net.to_dict()
    back = network_from_dict(net.job_dict())
    back.flat = net.flat
    assert back.step_into(back.context(8), x, y, 8, 0.1, 0.0, np.zeros(1, np.float32)) == (
        pytest.approx(net.step_into(net.context(8), x, y, 8, 0.1, 0.0, np.zeros(1, np.float32)))
    )


def test_parameters_and_gradients_are_views_of_flat_buffers():
    net = TorchNetwork(Padded(), SHAPE)
    ctx = net.context(4)
    w = net.layout["down.weight"]
    net.flat = np.arange(net.layout.size, dtype=np.float32)
    # the module, every thread's copy and the named views read the same memory
    assert float(net.module.down.weight.detach().flatten()[0]) == w.offset
    assert float(ctx.module.down.weight.detach().flatten()[0]) == w.offset
    assert ctx.module.down.weight.grad.data_ptr() == ctx.grad[w.offset :].ctypes.data
    assert net.state_dict()["down.weight"].flatten()[1] == w.offset + 1


def test_hogwild_threads_train_a_residual_module_well_above_chance():
    x, y = synthetic_digits(600, size=28, seed=1)
    xt, yt = synthetic_digits(200, size=28, seed=2)
    torch.manual_seed(0)
    net = TorchNetwork(ResidualNet(width=8), (1, 28, 28))
    rep = HogwildReplica(net, threads=2, lr=0.1, momentum=0.9, batch_size=16)
    st = rep.train_images(x, y, epochs=3, seed=0)
    assert st.images == 1800
    net.calibrate(x)  # batch norm: recomputed on the trained weights
    assert net.evaluate(xt, yt) >= 0.8  # chance is 0.1


def test_batch_norm_statistics_are_recomputed_after_new_weights():
    x, _ = synthetic_digits(64, size=28, seed=3)
    net = TorchNetwork.build(tiny_residual_net, (1, 28, 28), seed=0)
    assert net.batch_norm
    net.flat = net.flat * 1.5
    with pytest.raises(ModelSpecError, match="calibrate"):
        net.predict(x)
    net.calibrate(x)
    bn = net.module.stem[1]
    feats = net.module.stem[0](torch.from_numpy(net.as_images(x))).detach()
    np.testing.assert_allclose(
        bn.running_mean.numpy(), feats.mean(dim=(0, 2, 3)).numpy(), atol=1e-4
    )
    assert net.predict(x).shape == (64,)


def test_a_module_that_does_not_match_the_checkpoint_layout_is_refused_in_one_error():
    net = TorchNetwork.build("adam_dask.model.torch_examples:tiny_residual_net", (1, 28, 28))
    d = net.to_dict()
    back = network_from_dict(d)  # rebuilt from the factory, same layout
    assert back.layout == net.layout and back.factory == net.factory
    with pytest.raises(
        ModelSpecError, match=r"do not match the checkpoint's layout.*'stem\.0\.weight'"
    ):
        network_from_dict(d, model=lambda: ResidualNet(width=4))


def test_a_description_holds_no_pickle_but_a_job_carries_a_module_object():
    net = TorchNetwork(Padded(), SHAPE)
    assert "module_pickle" not in net.to_dict()
    with pytest.raises(ModelSpecError, match="cannot rebuild"):
        network_from_dict(net.to_dict())
    back = network_from_dict(net.job_dict())
    assert isinstance(back.module, Padded) and back.layout == net.layout


def test_engine_dispatch_and_bad_factories():
    assert is_factory_path("pkg.mod:make") and not is_factory_path("conv5x5:10,fc10")
    assert is_torch_model(Padded()) and is_torch_model(Padded) and not is_torch_model("fc10")
    with pytest.raises(ModelSpecError, match=r"cannot import 'no_such_pkg\.models'"):
        TorchNetwork.build("no_such_pkg.models:net", SHAPE)
    with pytest.raises(ModelSpecError, match=r"returned int, not an nn\.Module"):
        TorchNetwork.build(lambda: 3, SHAPE)
    with pytest.raises(ModelSpecError, match=r"fails on images of shape \(B, 1, 12, 12\)"):
        TorchNetwork.build(lambda: nn.Linear(5, 3), SHAPE)


def test_a_torch_model_is_not_partitioned_and_asking_for_it_is_one_error():
    """The partition plan splits the numba engine's layers; a user's module has none to split
    (it is the pipeline's one stage, on one worker): partitions=2 is refused before anything
    starts."""
    from adam_dask.errors import PartitionError
    from adam_dask.train._partition_task import cluster_plan

    net = TorchNetwork.build("adam_dask.model.torch_examples:tiny_residual_net", (1, 28, 28))
    with pytest.raises(PartitionError, match="partitions=2: a PyTorch model trains on one worker"):
        cluster_plan(None, net, None, 2)


def test_a_module_off_the_cpu_is_refused_in_one_line():
    """The engine trains on the CPU (the flat buffer is numpy): a module whose parameters live
    on another device (a CUDA module; the meta device stands in for it on a machine without a
    GPU) is refused, saying where they are and what to do, not moved without a word."""
    module = nn.Sequential(nn.Flatten(), nn.Linear(144, 3, device="meta"))
    with pytest.raises(ModelSpecError) as err:
        TorchNetwork(module, SHAPE)
    msg = str(err.value)
    assert "'1.weight' is on meta" in msg and "build the module on the CPU" in msg, msg
    assert "\n" not in msg
    # a float64 module on the CPU is still converted: that loses nothing the server keeps
    net = TorchNetwork(nn.Sequential(nn.Flatten(), nn.Linear(144, 3).double()), SHAPE)
    assert net.flat.dtype == np.float32
