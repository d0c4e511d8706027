"""Image augmentation kernels (numba): random affine warps and elastic distortion.

The two transformations that help most on MNIST-like data (Simard, Steinkraus and Platt 2003;
Project Adam section 3.1 pre-transforms images on the data-serving machines):

* a random **affine** warp about the image centre: rotation, isotropic scale, shear and
  translation, sampled bilinearly (pixels from outside the image read as 0);
* an **elastic** distortion: a random displacement field, uniform in [-1, 1] per pixel and per
  axis, smoothed by a Gaussian of width ``sigma`` (truncated at 3 sigma, zero outside the image)
  and scaled by ``alpha`` pixels.

Both are applied in one bilinear resampling pass. Every random number is a pure function of
``(seed, epoch, image index, draw number)`` (a counter-based SplitMix64 hash), so an image's
augmentation is reproducible, the same on whichever server or thread produces it, and different
in every epoch. Kernels work on a batch at a time and release the GIL (``nogil=True``), so a
background thread augments while the event loop serves.

Shape legend::

    B = images in the batch, H, W = image height and width, C = channels (1 for grey)
    images  (B, H, W, C) uint8      as stored (a grey store's (N, H, W) is viewed as C = 1)
    out     (B, C, H, W) float32    the model's layout, values in [0, 1] (see :func:`to_float`)
    indices (B,) int64              global image indices (the key of the random draws)

Example
-------
>>> import numpy as np
>>> aug = Augment(rotation=10.0, translation=2.0)
>>> x = aug.apply(np.zeros((4, 28, 28), np.uint8), np.arange(4), seed=0, epoch=1)
>>> x.shape, x.dtype
((4, 1, 28, 28), dtype('float32'))
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from .. import config
from ..errors import ConfigError, InputShapeError

logger = logging.getLogger(__name__)

__all__ = [
    "Augment",
    "affine_batch",
    "as_model_input",
    "augment_batch",
    "elastic_field",
    "to_float",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_TWO53 = 1.0 / 9007199254740992.0
_AFFINE_DRAWS = 8  # draw numbers 0..7 are the affine parameters; the field starts after


# -- counter-based random numbers --------------------------------------------------------------


@njit(cache=True, nogil=True)
def _mix64(z):
    """SplitMix64 finaliser: a bijective 64-bit hash (uint64 -> uint64)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def _key(seed, epoch, index):
    """The random key of one image in one epoch: a hash of (seed, epoch, index)."""
    k = _mix64(np.uint64(seed) + _GOLDEN)
    k = _mix64(k ^ (np.uint64(epoch) * _M1 + _GOLDEN))
    return _mix64(k ^ (np.uint64(index) * _M2 + _GOLDEN))


@njit(cache=True, nogil=True)
def _uniform(key, n):
    """Draw number ``n`` of ``key``: a float64 uniform in [0, 1)."""
    v = _mix64(key + np.uint64(n + 1) * _GOLDEN)
    return float(v >> _S11) * _TWO53


# -- building blocks -----------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _gaussian_taps(sigma):
    """A normalised 1-D Gaussian of width ``sigma``, truncated at 3 sigma: (2r+1,) float64."""
    r = max(1, int(3.0 * sigma + 0.5))
    taps = np.empty(2 * r + 1, np.float64)
    s = 0.0
    for i in range(2 * r + 1):
        d = (i - r) / sigma
        taps[i] = math.exp(-0.5 * d * d)
        s += taps[i]
    for i in range(2 * r + 1):
        taps[i] /= s
    return taps


@njit(cache=True, nogil=True)
def _smooth(field, taps, pad_x, pad_y):
    """Separable Gaussian blur of ``field`` (H, W) in place, zero outside the image.

    taps (2r+1,); scratch pad_x (H, W + 2r) and pad_y (H + 2r, W), whose borders must be 0.
    The innermost loops run over contiguous x, so LLVM vectorises them.
    """
    H, W = field.shape
    T = taps.shape[0]
    r = (T - 1) // 2
    for y in range(H):
        for x in range(W):
            pad_x[y, r + x] = field[y, x]
    for y in range(H):  # rows: pad_y[r + y] = taps * pad_x[y]
        for x in range(W):
            pad_y[r + y, x] = 0.0
        for t in range(T):
            w = taps[t]
            for x in range(W):
                pad_y[r + y, x] += w * pad_x[y, x + t]
    for y in range(H):  # columns: field[y] = taps * pad_y[y:y + T]
        for x in range(W):
            field[y, x] = 0.0
        for t in range(T):
            w = taps[t]
            for x in range(W):
                field[y, x] += w * pad_y[y + t, x]


@njit(cache=True, nogil=True)
def _field_one(dx, dy, key, alpha, taps, pad_x, pad_y):
    """The elastic displacement field of one image: dx, dy (H, W) float64, |d| <= alpha."""
    H, W = dx.shape
    n = _AFFINE_DRAWS
    for y in range(H):
        for x in range(W):
            dx[y, x] = 2.0 * _uniform(key, n) - 1.0
            dy[y, x] = 2.0 * _uniform(key, n + 1) - 1.0
            n += 2
    _smooth(dx, taps, pad_x, pad_y)
    _smooth(dy, taps, pad_x, pad_y)
    for y in range(H):
        for x in range(W):
            dx[y, x] *= alpha
            dy[y, x] *= alpha


@njit(cache=True, nogil=True)
def _warp_one(out, img, angle, scale, shear, tx, ty, dx, dy, use_field):
    """Resample one image: out (C, H, W) float32 <- img (H, W, C) uint8.

    The forward map takes a source pixel p to ``M (p - c) + c + t`` with
    ``M = R(angle) @ [[1, shear], [0, 1]] @ scale`` about the centre c; the output pixel q reads
    the source at ``M^-1 (q + d(q) - c - t) + c`` (d = elastic displacement), bilinearly.
    """
    H, W, C = img.shape
    ca, sa = math.cos(angle), math.sin(angle)
    # M = R @ Sh @ S
    m00 = ca * scale
    m01 = (ca * shear - sa) * scale
    m10 = sa * scale
    m11 = (sa * shear + ca) * scale
    det = m00 * m11 - m01 * m10
    i00, i01, i10, i11 = m11 / det, -m01 / det, -m10 / det, m00 / det
    cx, cy = 0.5 * (W - 1), 0.5 * (H - 1)
    for y in range(H):
        for x in range(W):
            u = x - cx - tx
            v = y - cy - ty
            if use_field:
                u += dx[y, x]
                v += dy[y, x]
            xs = i00 * u + i01 * v + cx
            ys = i10 * u + i11 * v + cy
            x0f = math.floor(xs)
            y0f = math.floor(ys)
            fx = xs - x0f
            fy = ys - y0f
            x0 = int(x0f)
            y0 = int(y0f)
            for c in range(C):
                acc = 0.0
                if 0 <= y0 < H:
                    if 0 <= x0 < W:
                        acc += (1.0 - fx) * (1.0 - fy) * img[y0, x0, c]
                    if 0 <= x0 + 1 < W and fx > 0.0:
                        acc += fx * (1.0 - fy) * img[y0, x0 + 1, c]
                if 0 <= y0 + 1 < H and fy > 0.0:
                    if 0 <= x0 < W:
                        acc += (1.0 - fx) * fy * img[y0 + 1, x0, c]
                    if 0 <= x0 + 1 < W and fx > 0.0:
                        acc += fx * fy * img[y0 + 1, x0 + 1, c]
                out[c, y, x] = np.float32(min(1.0, max(0.0, acc / 255.0)))


# -- batch kernels ---------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def augment_batch(
    out, images, indices, seed, epoch, rotation, translation, scale, shear, alpha, sigma
):
    """Augment a batch: out (B, C, H, W) float32 <- images (B, H, W, C) uint8.

    Image b gets the draws of key (seed, epoch, indices[b]): angle ~ U(-rotation, rotation)
    degrees, scale factor ~ 1 + U(-scale, scale), shear ~ U(-shear, shear), tx, ty ~
    U(-translation, translation) pixels, and (when alpha > 0) an elastic field of strength alpha
    and width sigma.
    """
    B, H, W, C = images.shape
    use_field = alpha > 0.0
    taps = _gaussian_taps(max(sigma, 1e-3))
    r = (taps.shape[0] - 1) // 2
    dx = np.zeros((H, W), np.float64)
    dy = np.zeros((H, W), np.float64)
    pad_x = np.zeros((H, W + 2 * r), np.float64)
    pad_y = np.zeros((H + 2 * r, W), np.float64)
    for b in range(B):
        key = _key(seed, epoch, indices[b])
        angle = (2.0 * _uniform(key, 0) - 1.0) * rotation * (math.pi / 180.0)
        s = 1.0 + (2.0 * _uniform(key, 1) - 1.0) * scale
        sh = (2.0 * _uniform(key, 2) - 1.0) * shear
        tx = (2.0 * _uniform(key, 3) - 1.0) * translation
        ty = (2.0 * _uniform(key, 4) - 1.0) * translation
        if use_field:
            _field_one(dx, dy, key, alpha, taps, pad_x, pad_y)
        _warp_one(out[b], images[b], angle, s, sh, tx, ty, dx, dy, use_field)


@njit(cache=True, nogil=True)
def affine_batch(out, images, params):
    """Warp with explicit parameters: out (B, C, H, W) float32 <- images (B, H, W, C) uint8.

    params (B, 5) float64: angle (radians), scale, shear, tx, ty (pixels); (0, 1, 0, 0, 0) is the
    identity and (0, 1, 0, tx, ty) moves the image tx pixels right and ty pixels down.
    """
    B, H, W, C = images.shape
    dx = np.zeros((1, 1), np.float64)
    for b in range(B):
        _warp_one(
            out[b],
            images[b],
            params[b, 0],
            params[b, 1],
            params[b, 2],
            params[b, 3],
            params[b, 4],
            dx,
            dx,
            False,
        )


@njit(cache=True, nogil=True)
def elastic_field(dx, dy, seed, epoch, index, alpha, sigma):
    """The elastic displacement field that ``augment_batch`` uses for one image.

    dx, dy (H, W) float64, filled in place; smooth, and bounded by alpha in absolute value.
    """
    H, W = dx.shape
    taps = _gaussian_taps(max(sigma, 1e-3))
    r = (taps.shape[0] - 1) // 2
    pad_x = np.zeros((H, W + 2 * r), np.float64)
    pad_y = np.zeros((H + 2 * r, W), np.float64)
    _field_one(dx, dy, _key(seed, epoch, index), alpha, taps, pad_x, pad_y)


# -- the configuration object ---------------------------------------------------------------------


def _as_bhwc(images: np.ndarray) -> np.ndarray:
    """(B, H, W) or (B, H, W, C) uint8 -> a C-contiguous (B, H, W, C) view or copy."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise InputShapeError(
            f"images are {images.dtype} {images.shape}, expected uint8 (B, H, W) or (B, H, W, C)",
            "pass the arrays of a dataset store",
        )
    if images.ndim == 3:
        images = images[..., None]
    return np.ascontiguousarray(images)


def to_float(images: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Pixels uint8 -> float32 in [0, 1]: ``images / 255``, correctly rounded, shape kept.

    The package's one input conversion: served batches, evaluation arrays and unaugmented
    images all go through it, so a pixel has the same float everywhere. ``out`` (float32, the
    shape of ``images``) receives the result when given; a transposed view of ``images`` with
    a C-ordered ``out`` changes the layout in the same pass.

    >>> to_float(np.array([0, 51, 255], np.uint8))
    array([0. , 0.2, 1. ], dtype=float32)
    """
    x = np.asarray(images)
    if x.dtype != np.uint8:
        raise InputShapeError(
            f"to_float takes uint8 pixels, got {x.dtype}", "pass the arrays of a dataset store"
        )
    if out is None:
        out = np.empty(x.shape, np.float32)
    np.divide(x, np.float32(255.0), out=out, dtype=np.float32)
    return out


def as_model_input(images: np.ndarray) -> np.ndarray:
    """Stored images (N, H, W[, C]) uint8 -> the model's input (N, C, H, W) float32 in [0, 1]."""
    x = _as_bhwc(images)
    out = np.empty((x.shape[0], x.shape[3], x.shape[1], x.shape[2]), np.float32)
    return to_float(x.transpose(0, 3, 1, 2), out=out)


@dataclass(frozen=True, slots=True)
class Augment:
    """Which transformations to apply and their ranges (each drawn uniformly in +-range).

    Parameters
    ----------
    rotation : float
        Degrees, +-.
    translation : float
        Pixels, +-, independently in x and y.
    scale : float
        Fraction, +-: the scale factor is drawn in [1 - scale, 1 + scale].
    shear : float
        Shear factor (~ radians for small values), +-.
    elastic_alpha : float
        Elastic distortion strength in pixels; 0 disables it.
    elastic_sigma : float
        Width (pixels) of the Gaussian that smooths the elastic displacement field.

    ``Augment()`` is the identity; :meth:`from_config` reads the ``adam.augment`` section.
    """

    rotation: float = 0.0
    translation: float = 0.0
    scale: float = 0.0
    shear: float = 0.0
    elastic_alpha: float = 0.0
    elastic_sigma: float = 4.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"augment {name}={value!r} is invalid",
                    f"give a finite number >= 0 (adam.augment.{name.replace('_', '-')})",
                )
        if self.scale >= 1:
            raise ConfigError(
                f"augment scale={self.scale} would allow a scale factor <= 0",
                "give a fraction below 1, e.g. 0.1",
            )
        if self.elastic_alpha > 0 and self.elastic_sigma <= 0:
            raise ConfigError(
                "augment elastic_sigma must be > 0 when elastic_alpha > 0",
                "set adam.augment.elastic-sigma, e.g. 4.0",
            )

    @classmethod
    def from_config(cls, **overrides: float) -> Augment:
        """The ``adam.augment`` settings (keyword arguments win), ignoring ``enabled``."""
        kw = {}
        for name in ("rotation", "translation", "scale", "shear", "elastic_alpha", "elastic_sigma"):
            kw[name] = float(config.get(f"augment.{name.replace('_', '-')}", overrides.get(name)))
        return cls(**kw)

    @classmethod
    def default(cls) -> Augment | None:
        """``from_config()`` when ``adam.augment.enabled`` is true, else ``None`` (no augmentation)."""
        return cls.from_config() if config.get("augment.enabled") else None

    @property
    def is_identity(self) -> bool:
        return (
            self.rotation == 0
            and self.translation == 0
            and self.scale == 0
            and self.shear == 0
            and self.elastic_alpha == 0
        )

    def apply(
        self,
        images: np.ndarray,
        indices: np.ndarray,
        *,
        seed: int = 0,
        epoch: int = 0,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Augment ``images`` (B, H, W[, C]) uint8 -> (B, C, H, W) float32 in [0, 1].

        ``indices`` (B,) are the images' global indices in the dataset: with ``seed`` and
        ``epoch`` they fix every random draw, so the same call gives the same output.
        """
        x = _as_bhwc(images)
        B, H, W, C = x.shape
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        if idx.shape[0] != B:
            raise InputShapeError(
                f"{idx.shape[0]} indices for {B} images", "give one global index per image"
            )
        if out is None:
            out = np.empty((B, C, H, W), np.float32)
        elif out.shape != (B, C, H, W) or out.dtype != np.float32:
            raise InputShapeError(
                f"out is {out.dtype} {out.shape}, expected float32 {(B, C, H, W)}",
                "allocate out with the batch's shape",
            )
        if self.is_identity:
            to_float(x.transpose(0, 3, 1, 2), out=out)
        else:
            augment_batch(
                out,
                x,
                idx,
                int(seed) & 0xFFFFFFFFFFFFFFFF,
                int(epoch),
                float(self.rotation),
                float(self.translation),
                float(self.scale),
                float(self.shear),
                float(self.elastic_alpha),
                float(self.elastic_sigma),
            )
        return out
