"""Network: the spec, the parameter contract, loss_and_gradient against a float64 reference and
finite differences, the dense-layer offload terms, and clear errors for bad specs and inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adam_dask.errors import InputShapeError, ModelSpecError
from adam_dask.model import Network, ParameterLayout
from adam_dask.model import reference as R

PAPER = "conv5x5:10,maxpool2,conv5x5:20,maxpool2,fc400,fc400,fc10"
SMALL = "conv3x3:3,maxpool2,conv2x2:4,fc6,fc3"


def reference_loss(net: Network, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """The mean loss of ``net``'s plan with weights ``flat``, composed from the float64
    references in the textbook order (conv -> act -> pool)."""
    p = (
        net.layout.views(flat.astype(np.float32))
        if flat.dtype == np.float32
        else {e.name: flat[e.offset : e.offset + e.size].reshape(e.shape) for e in net.layout}
    )
    act = R.tanh_forward if net.activation == "tanh" else R.relu_forward
    h = x.astype(np.float64)
    for L in net.layers:
        i = L.index
        if L.kind == "conv":
            h = R.conv2d_forward(h, p[f"{i}.weight"], p[f"{i}.bias"])
        elif L.kind == "maxpool":
            h = R.maxpool2_forward(h)[0]
        else:
            h = R.dense_forward(h.reshape(len(h), -1), p[f"{i}.weight"], p[f"{i}.bias"])
        if L is not net.layers[-1] and L.kind != "maxpool":
            h = act(h)
    return R.softmax_cross_entropy_forward(h, y)[1]


@pytest.fixture(params=["tanh", "relu"])
def small(request):
    net = Network.from_spec(SMALL, input_shape=(2, 9, 9), activation=request.param, seed=3)
    rng = np.random.default_rng(1)
    x = rng.random((4, 2, 9, 9), dtype=np.float32)
    y = rng.integers(0, 3, 4)
    return net, x, y


def test_paper_network_names_and_torch_layouts():
    net = Network.from_spec(PAPER, input_shape=(1, 28, 28), activation="tanh", seed=0)
    shapes = {k: v.shape for k, v in net.parameters.items()}
    assert shapes == {
        "0.weight": (10, 1, 5, 5),
        "0.bias": (10,),
        "2.weight": (20, 10, 5, 5),
        "2.bias": (20,),
        "4.weight": (400, 320),
        "4.bias": (400,),
        "5.weight": (400, 400),
        "5.bias": (400,),
        "6.weight": (10, 400),
        "6.bias": (10,),
    }
    assert list(net.parameters) == [e.name for e in net.layout]
    assert isinstance(net.layout, ParameterLayout)
    assert net.flat.dtype == np.float32 and net.flat.ndim == 1
    assert net.flat.size == net.layout.size == sum(v.size for v in net.parameters.values())
    for v in net.parameters.values():
        assert np.shares_memory(v, net.flat)
    w = net.parameters["4.weight"]
    assert 0 < np.abs(w).max() <= np.sqrt(6 / (320 + 400)) + 1e-6  # Glorot for tanh
    assert not net.parameters["4.bias"].any()
    x = np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32)
    logits = net.forward(x)
    assert logits.shape == (3, 10) and logits.dtype == np.float32
    assert net.predict(x).shape == (3,)


def test_seed_and_activation_initialisation():
    a = Network.from_spec(SMALL, (2, 9, 9), "tanh", seed=1)
    b = Network.from_spec(SMALL, (2, 9, 9), "tanh", seed=1)
    c = Network.from_spec(SMALL, (2, 9, 9), "tanh", seed=2)
    np.testing.assert_array_equal(a.flat, b.flat)
    assert not np.array_equal(a.flat, c.flat)
    r = Network.from_spec("fc300,fc10", (1, 20, 20), "relu", seed=0)
    assert abs(r.parameters["0.weight"].std() - np.sqrt(2 / 400)) < 0.005  # He for relu


def test_forward_matches_reference(small):
    net, x, y = small
    loss, _ = net.loss_and_gradient(x, y)
    assert abs(loss - reference_loss(net, net.flat.astype(np.float64), x, y)) < 1e-5


def test_loss_and_gradient_against_finite_differences(small):
    net, x, y = small
    loss, grad = net.loss_and_gradient(x, y)
    assert grad.dtype == np.float32 and grad.shape == net.flat.shape
    w64 = net.flat.astype(np.float64)
    eps = 1e-6
    rng = np.random.default_rng(0)
    idx = np.concatenate(
        [rng.choice(e.size, min(e.size, 6), replace=False) + e.offset for e in net.layout]
    )
    for i in idx:
        wp, wm = w64.copy(), w64.copy()
        wp[i] += eps
        wm[i] -= eps
        fd = (reference_loss(net, wp, x, y) - reference_loss(net, wm, x, y)) / (2 * eps)
        assert abs(fd - grad[i]) <= 1e-4 + 1e-3 * abs(fd), (i, fd, grad[i])


def test_gradient_is_a_fresh_copy_and_repeatable(small):
    net, x, y = small
    l1, g1 = net.loss_and_gradient(x, y)
    l2, g2 = net.loss_and_gradient(x, y)
    assert l1 == l2
    np.testing.assert_array_equal(g1, g2)
    assert not np.shares_memory(g1, g2)


def test_dense_terms_give_the_dense_gradients(small):
    net, x, y = small
    loss, grad, terms = net.loss_and_gradient(x, y, dense_terms=True)
    assert set(terms) == {"3", "4"}
    g = net.layout.views(grad)
    for prefix, (acts, errs) in terms.items():
        assert acts.dtype == errs.dtype == np.float32
        assert acts.shape == (4, net.parameters[f"{prefix}.weight"].shape[1])
        assert errs.shape == (4, net.parameters[f"{prefix}.weight"].shape[0])
        np.testing.assert_allclose(errs.T @ acts, g[f"{prefix}.weight"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(errs.sum(0), g[f"{prefix}.bias"], rtol=1e-5, atol=1e-7)


def test_gradient_descent_lowers_the_loss(small):
    net, x, y = small
    first, _ = net.loss_and_gradient(x, y)
    for _ in range(30):
        _, g = net.loss_and_gradient(x, y)
        net.flat -= 0.5 * g
    assert net.loss_and_gradient(x, y)[0] < first * 0.5


def test_batches_of_any_size_give_consistent_logits(small):
    net, x, _ = small
    full = net.forward(x)
    np.testing.assert_allclose(net.forward(x, batch_size=3), full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(net.forward(x[1:2]), full[1:2], rtol=1e-6, atol=1e-6)


def test_to_dict_from_dict_and_copy(small):
    net, x, _ = small
    d = json.loads(json.dumps(net.to_dict()))
    assert d["spec"] == SMALL and d["classes"] == 3 and d["input_shape"] == [2, 9, 9]
    other = Network.from_dict(d)
    assert other.layout == net.layout and other.activation == net.activation
    c = net.copy()
    np.testing.assert_array_equal(c.flat, net.flat)
    assert not np.shares_memory(c.flat, net.flat)
    np.testing.assert_array_equal(c.forward(x), net.forward(x))
    c.flat += 1.0
    assert not np.array_equal(c.flat, net.flat)


def test_flat_assignment_keeps_views(small):
    net, _, _ = small
    views = net.parameters
    net.flat = np.zeros(net.flat.size, np.float32)
    assert not views["0.weight"].any()
    with pytest.raises(InputShapeError):
        net.flat = np.zeros(3, np.float32)


def test_evaluate_accepts_uint8_images():
    net = Network.from_spec("conv3x3:2,fc4", input_shape=(1, 6, 6), seed=0)
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (10, 6, 6), dtype=np.uint8)
    pred = net.predict(imgs)
    assert np.array_equal(pred, net.predict(imgs[:, None].astype(np.float32) / 255))
    assert net.evaluate(imgs, pred) == 1.0
    assert 0.0 <= net.evaluate(imgs, np.zeros(10, np.int64), batch_size=3) <= 1.0


def test_config_defaults_are_used():
    import dask

    net = Network.from_spec()
    assert net.spec == PAPER and net.input_shape == (1, 28, 28)
    assert net.activation == dask.config.get("adam.model.activation")
    with dask.config.set({"adam.model.activation": "tanh", "adam.model.spec": "conv3x3:2,fc10"}):
        net = Network.from_spec(input_shape=(1, 8, 8))
    assert net.activation == "tanh" and net.spec == "conv3x3:2,fc10"


@pytest.mark.parametrize(
    "spec, layer",
    [
        ("conv5x5:10,maxpool2,bogus,fc10", 2),
        ("conv5x5:10,maxpool3,fc10", 1),
        ("conv30x30:4,fc10", 0),
        ("conv5x5:10,maxpool2,conv5x5:20,maxpool2,conv5x5:8,fc10", 4),
        ("fc10,conv3x3:2,fc10", 1),
        ("fc10,maxpool2,fc10", 1),
        ("conv5x5:10,maxpool2", 1),
        ("fc1", 0),
        ("conv5x5:0,fc10", 0),
    ],
)
def test_bad_specs_name_the_layer(spec, layer):
    with pytest.raises(ModelSpecError) as info:
        Network.from_spec(spec, input_shape=(1, 28, 28))
    assert info.value.layer == layer
    assert f"layer {layer}" in str(info.value)


def test_bad_spec_arguments():
    with pytest.raises(ModelSpecError):
        Network.from_spec("", input_shape=(1, 28, 28))
    with pytest.raises(ModelSpecError, match="activation"):
        Network.from_spec("fc10", activation="sigmoid")
    with pytest.raises(ModelSpecError, match="input_shape"):
        Network.from_spec("fc10", input_shape=(1, 0, 28))


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 28, 28), np.float32),  # missing channel axis
        np.zeros((2, 1, 27, 28), np.float32),  # wrong size
        np.zeros((2, 3, 28, 28), np.float32),  # wrong channels
        np.zeros((2, 1, 28, 28), np.int32),  # not float
        np.zeros((2, 1, 28, 28), np.uint8),
        np.zeros((0, 1, 28, 28), np.float32),  # empty
        "not an array",
    ],
)
def test_bad_inputs_give_input_shape_error(bad):
    net = Network.from_spec("conv5x5:2,maxpool2,fc10", input_shape=(1, 28, 28))
    with pytest.raises(InputShapeError):
        net.forward(bad)
    with pytest.raises(InputShapeError):
        net.loss_and_gradient(bad, np.zeros(2, np.int64))


@pytest.mark.parametrize(
    "labels",
    [
        np.zeros(3, np.int64),
        np.array([0, 10]),
        np.array([0, -1]),
        np.array([0.0, 1.0]),
        np.zeros((2, 1), np.int64),
    ],
)
def test_bad_labels_give_input_shape_error(labels):
    net = Network.from_spec("conv5x5:2,maxpool2,fc10", input_shape=(1, 28, 28))
    with pytest.raises(InputShapeError):
        net.loss_and_gradient(np.zeros((2, 1, 28, 28), np.float32), labels)


def test_float64_and_non_contiguous_inputs_are_accepted():
    net = Network.from_spec("conv3x3:2,fc4", input_shape=(1, 6, 6), seed=0)
    x = np.random.default_rng(0).random((4, 1, 6, 12))
    a = net.forward(x[:, :, :, ::2])
    b = net.forward(np.ascontiguousarray(x[:, :, :, ::2], dtype=np.float32))
    np.testing.assert_allclose(a, b, rtol=1e-6)
