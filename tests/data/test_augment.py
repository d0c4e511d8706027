"""Augmentation kernels: identity, exact translations and rotations, the elastic field,
reproducibility per (seed, epoch, index), output range, colour images, configuration."""

from __future__ import annotations

import dask
import numpy as np
import pytest

from adam_dask import config
from adam_dask.data.augment import Augment, affine_batch, as_model_input, elastic_field
from adam_dask.errors import ConfigError, InputShapeError
from adam_dask.testing import synthetic_digits

FULL = Augment(
    rotation=10.0, translation=2.0, scale=0.1, shear=0.1, elastic_alpha=34.0, elastic_sigma=4.0
)


@pytest.fixture(scope="module")
def grey():
    return synthetic_digits(16, seed=3)[0]  # (16, 28, 28) uint8


@pytest.fixture(scope="module")
def colour():
    rng = np.random.default_rng(5)
    return rng.integers(0, 256, size=(4, 20, 24, 3), dtype=np.uint8)  # non-square, RGB


def _bhwc(images):
    return images[..., None] if images.ndim == 3 else images


def _warp(images, params):
    x = np.ascontiguousarray(_bhwc(images))
    out = np.empty((x.shape[0], x.shape[3], x.shape[1], x.shape[2]), np.float32)
    affine_batch(out, x, np.asarray(params, np.float64).reshape(x.shape[0], 5))
    return out


def _expected(images):
    """The model's layout of the unchanged images: (B, C, H, W) float32 = uint8 / 255."""
    return np.moveaxis(_bhwc(images), -1, 1).astype(np.float32) / np.float32(255)


@pytest.mark.parametrize("which", ["grey", "colour"])
def test_identity_gives_the_input_back(request, which):
    images = request.getfixturevalue(which)
    n = len(images)
    np.testing.assert_array_equal(
        Augment().apply(images, np.arange(n), seed=1, epoch=7), _expected(images)
    )
    np.testing.assert_array_equal(_warp(images, [[0, 1, 0, 0, 0]] * n), _expected(images))
    np.testing.assert_array_equal(as_model_input(images), _expected(images))


@pytest.mark.parametrize("which", ["grey", "colour"])
@pytest.mark.parametrize("tx,ty", [(2, 3), (-4, 1), (0, -2)])
def test_translation_moves_by_the_right_pixels(request, which, tx, ty):
    images = request.getfixturevalue(which)
    out = _warp(images, [[0, 1, 0, tx, ty]] * len(images))
    want = np.zeros_like(out)
    src = _expected(images)
    H, W = src.shape[2:]
    want[:, :, max(0, ty) : H + min(0, ty), max(0, tx) : W + min(0, tx)] = src[
        :, :, max(0, -ty) : H - max(0, ty), max(0, -tx) : W - max(0, tx)
    ]
    np.testing.assert_array_equal(out, want)


def test_quarter_turn_is_a_rotation_about_the_centre(grey):
    out = _warp(grey, [[np.pi / 2, 1, 0, 0, 0]] * len(grey))
    np.testing.assert_allclose(
        out[:, 0], np.rot90(_expected(grey)[:, 0], k=-1, axes=(1, 2)), atol=1e-5
    )


def test_elastic_field_is_smooth_and_bounded():
    H, W, alpha = 28, 28, 34.0
    roughness = {}
    for sigma in (2.0, 4.0, 6.0):
        dx, dy = np.zeros((H, W)), np.zeros((H, W))
        elastic_field(dx, dy, 0, 0, 11, alpha, sigma)
        for d in (dx, dy):
            assert np.all(np.isfinite(d))
            assert np.abs(d).max() <= alpha  # a weighted mean of values in [-1, 1], times alpha
            assert d.std() > 0
        # neighbouring displacements differ far less than the field varies (white noise: ~1.4)
        step = np.abs(np.diff(dx, axis=1)).mean() + np.abs(np.diff(dx, axis=0)).mean()
        roughness[sigma] = step / (2 * dx.std())
        assert roughness[sigma] < 0.6
    assert roughness[6.0] < roughness[2.0]  # a wider Gaussian is smoother
    zero_x, zero_y = np.ones((H, W)), np.ones((H, W))
    elastic_field(zero_x, zero_y, 0, 0, 11, 0.0, 4.0)
    assert not zero_x.any() and not zero_y.any()  # alpha = 0: no displacement


def test_same_seed_same_output_new_epoch_new_output(grey):
    idx = np.arange(100, 100 + len(grey))
    a = FULL.apply(grey, idx, seed=7, epoch=3)
    np.testing.assert_array_equal(a, FULL.apply(grey, idx, seed=7, epoch=3))
    # an image's draws depend on its index, not on the batch it travels in
    np.testing.assert_array_equal(a[5:9], FULL.apply(grey[5:9], idx[5:9], seed=7, epoch=3))
    b = FULL.apply(grey, idx, seed=7, epoch=4)
    c = FULL.apply(grey, idx, seed=8, epoch=3)
    for other in (b, c):
        changed = [not np.array_equal(a[i], other[i]) for i in range(len(grey))]
        assert all(changed)
    # the same pixels under a different index get different draws
    assert not np.array_equal(a[0], FULL.apply(grey[:1], idx[1:2], seed=7, epoch=3)[0])


@pytest.mark.parametrize(
    "aug",
    [
        FULL,
        Augment(rotation=180.0, translation=10.0, scale=0.9, shear=2.0),
        Augment(elastic_alpha=200.0, elastic_sigma=1.0),
    ],
)
@pytest.mark.parametrize("which", ["grey", "colour"])
def test_output_stays_in_range(request, aug, which):
    images = request.getfixturevalue(which)
    images = np.concatenate([images, np.full_like(images[:2], 255)])
    out = aug.apply(images, np.arange(len(images)), seed=0, epoch=1)
    C = 1 if images.ndim == 3 else images.shape[-1]
    assert out.shape == (len(images), C) + images.shape[1:3] and out.dtype == np.float32
    assert np.all(np.isfinite(out)) and out.min() >= 0.0 and out.max() <= 1.0


def test_augmentation_changes_images_but_keeps_their_mass(grey):
    out = FULL.apply(grey, np.arange(len(grey)), seed=0, epoch=0)
    src = _expected(grey)
    assert not np.array_equal(out, src)
    ratio = out.sum(axis=(1, 2, 3)) / src.sum(axis=(1, 2, 3))
    assert np.all((ratio > 0.5) & (ratio < 1.5))  # a warp, not a wipe-out


def test_config_and_validation():
    a = Augment.from_config()
    assert (a.rotation, a.elastic_alpha, a.elastic_sigma) == (
        config.get("augment.rotation"),
        config.get("augment.elastic-alpha"),
        config.get("augment.elastic-sigma"),
    )
    with dask.config.set({"adam.augment.rotation": 7.5, "adam.augment.shear": 0.2}):
        b = Augment.from_config()
    assert (b.rotation, b.shear) == (7.5, 0.2)
    assert Augment.from_config(rotation=3.0).rotation == 3.0
    assert Augment().is_identity and not a.is_identity
    with pytest.raises(ConfigError, match="rotation"):
        Augment(rotation=-1.0)
    with pytest.raises(ConfigError, match="scale"):
        Augment(scale=1.5)
    with pytest.raises(InputShapeError):
        Augment().apply(np.zeros((2, 4, 4), np.float32), np.arange(2))
    with pytest.raises(InputShapeError):
        Augment().apply(np.zeros((2, 4, 4), np.uint8), np.arange(3))
