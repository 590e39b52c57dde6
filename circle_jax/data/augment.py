"""Image preprocessing presets of the deep-metric-learning papers (PIL/numpy).

A preset turns encoded image bytes into a float32 ``[H, W, C]`` array. It runs
in the input pipeline's worker threads/processes (:mod:`.pipeline`), with an
explicit ``numpy.random.Generator`` for the random parts, so every augmented
image is a deterministic function of ``(seed, step, position in the batch)``.

Presets (``get_preprocess(name, train=...)``):

``imagenet``
  RGB in [0, 1], then ``(x - mean) / std`` with the ImageNet statistics
  mean = (0.485, 0.456, 0.406), std = (0.229, 0.224, 0.225) (ResNet-50).
``clip``, ``inception``
  ``imagenet`` with the mean and std of another checkpoint family (for the ViT
  families of :data:`circle_jax.models.VIT_FAMILIES`): CLIP's mean =
  (0.48145466, 0.4578275, 0.40821073), std = (0.26862954, 0.26130258,
  0.27577711); ``inception`` mean = std = (0.5, 0.5, 0.5) (AugReg, SigLIP).
``bninception``
  BGR channel order, values x255 (0..255), minus mean (104, 117, 128), std 1:
  the Caffe BN-Inception convention used by the Multi-Similarity, Circle and
  Proxy-Anchor code.
``grayscale``
  One channel in [0, 1] (white = 1), resized to ``image_size`` (e.g. 28 or
  105 for Omniglot); for Omniglot and digits.
``grayscale_affine``
  ``grayscale`` whose train variant then applies a small random affine map
  to the resized image (:func:`random_affine`): a shift of up to
  ``affine_shift`` of the image size, a rotation of up to ``affine_degrees``,
  a scale in ``affine_scale`` and an x-shear of up to ``affine_shear``
  degrees about the centre, filling with the border's most common value
  (the paper background); the distortions of Koch, Zemel, Salakhutdinov,
  "Siamese Neural Networks for One-shot Image Recognition", ICML Deep
  Learning Workshop 2015. With ``elastic_alpha > 0`` an elastic distortion
  follows (:func:`elastic_distort`; Simard, Steinkraus, Platt, "Best
  Practices for Convolutional Neural Networks Applied to Visual Document
  Analysis", ICDAR 2003): the local wobble of strokes that differs between
  two people's drawings of one character. Its eval variant is
  ``grayscale``'s.

Train / eval variants (the torchvision transforms of the papers' code):

* train (RGB presets): random-resized-crop to ``image_size`` (area fraction
  ``scale``, default (0.08, 1) as in Proxy-Anchor; the MS code uses
  (0.16, 1)), aspect ratio in ``ratio`` = (3/4, 4/3), then a horizontal flip
  with probability 1/2.
* eval (RGB presets): resize the shorter side to ``resize_size`` (256)
  then centre-crop ``image_size`` (224, or 227 for the MS/Circle setting).
* grayscale: resize to ``image_size`` x ``image_size`` in both variants (no
  random augmentation unless ``flip=True`` is asked for; ``grayscale_affine``
  applies its random affine map after the resize, where it is cheap).

Resizing uses PIL's bilinear filter, which antialiases when downsampling
(the behaviour of torchvision's PIL backend the papers used).
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Optional, Tuple

import numpy as np
from PIL import Image

from circle_jax.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BNINCEPTION_MEAN_BGR = (104.0, 117.0, 128.0)
# RGB [0, 1] presets: name -> (mean, std).
RGB_NORMALISATION = {
    "imagenet": (IMAGENET_MEAN, IMAGENET_STD),
    "clip": ((0.48145466, 0.4578275, 0.40821073),
             (0.26862954, 0.26130258, 0.27577711)),
    "inception": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}

PRESETS = ("bninception", "imagenet", "grayscale", "grayscale_affine", "clip",
           "inception")
_GRAY = ("grayscale", "grayscale_affine")
# grayscale_affine's default ranges: shift (fraction of the size), rotation
# (degrees), scale, x-shear (degrees).
AFFINE_DEFAULTS = dict(affine_shift=0.1, affine_degrees=10.0,
                       affine_scale=(0.9, 1.1), affine_shear=10.0,
                       elastic_alpha=0.0, elastic_sigma=4.0)


class ImageDecodeError(UserError, ValueError):
  """An encoded image could not be decoded; the message names the file."""


def decode(data: bytes, mode: str, where: str = "<image>") -> Image.Image:
  """Decodes encoded image bytes to a PIL image in `mode` ('RGB' or 'L')."""
  try:
    with Image.open(io.BytesIO(bytes(data))) as im:
      im.load()
      if im.mode in ("RGBA", "LA", "P") and mode == "RGB":
        im = im.convert("RGBA")
        background = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, im)
      return im.convert(mode)
  except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ...
    raise ImageDecodeError(
        f"Cannot decode image {where}: {type(e).__name__}: {e}") from e


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
  """Samples a crop box ``(left, top, right, bottom)`` like torchvision.

  Ten tries to draw an area fraction uniformly in `scale` and a log-uniform
  aspect ratio in `ratio` that fit in the image; otherwise the largest
  centred crop with the aspect ratio clamped to `ratio`.
  """
  area = width * height
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target_area = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
    w = int(round(math.sqrt(target_area * aspect)))
    h = int(round(math.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return left, top, left + w, top + h
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, int(round(width / min(ratio)))
  elif in_ratio > max(ratio):
    h, w = height, int(round(height * max(ratio)))
  else:
    w, h = width, height
  top, left = (height - h) // 2, (width - w) // 2
  return left, top, left + w, top + h


def resize_shorter(im: Image.Image, size: int) -> Image.Image:
  """Resizes so the shorter side is `size`, keeping the aspect ratio."""
  w, h = im.size
  if w <= h:
    new = (size, max(1, int(size * h / w)))
  else:
    new = (max(1, int(size * w / h)), size)
  return im if new == (w, h) else im.resize(new, Image.BILINEAR)


def center_crop(im: Image.Image, size: int) -> Image.Image:
  """Centre crop to ``size x size`` (padding with black if the image is smaller)."""
  w, h = im.size
  if w < size or h < size:
    canvas = Image.new(im.mode, (max(w, size), max(h, size)))
    canvas.paste(im, ((max(w, size) - w) // 2, (max(h, size) - h) // 2))
    im, (w, h) = canvas, canvas.size
  top = int(round((h - size) / 2.0))
  left = int(round((w - size) / 2.0))
  return im.crop((left, top, left + size, top + size))


def affine_transform(im: Image.Image, *, shift=(0.0, 0.0), degrees=0.0,
                     scale=1.0, shear=0.0, fill=0) -> Image.Image:
  """`im` under an affine map about its centre (PIL bilinear, same size).

  The forward map sends a point ``p`` to ``c + t + R S H (p - c)``, with
  ``c`` the image centre, ``t = shift`` in pixels ``(dx, dy)`` (right,
  down), ``R`` a counter-clockwise rotation by `degrees` as seen on the
  screen, ``S`` the isotropic `scale` and ``H`` the x-shear ``[[1,
  tan(shear)], [0, 1]]`` (`shear` in degrees). Pixels that come from outside
  the image are `fill`. An integer shift with the other parameters at their
  identity moves the pixels exactly.
  """
  cx, cy = im.size[0] / 2.0, im.size[1] / 2.0
  a = math.radians(degrees)
  # y points down: a counter-clockwise screen rotation is [[c, s], [-s, c]].
  rot = np.array([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]])
  forward = rot @ np.array([[1.0, math.tan(math.radians(shear))],
                            [0.0, 1.0]]) * float(scale)
  inverse = np.linalg.inv(forward)
  # PIL wants output -> input: p = c + inverse (q - c - t).
  offset = np.array([cx, cy]) - inverse @ (np.array([cx, cy]) +
                                           np.asarray(shift, float))
  coeffs = (inverse[0, 0], inverse[0, 1], offset[0],
            inverse[1, 0], inverse[1, 1], offset[1])
  return im.transform(im.size, Image.Transform.AFFINE, coeffs,
                      resample=Image.BILINEAR, fillcolor=fill)


def border_mode(im: Image.Image) -> int:
  """The most common value of the outermost pixels of a mode-'L' image."""
  a = np.asarray(im, np.uint8)
  border = np.concatenate([a[0], a[-1], a[1:-1, 0], a[1:-1, -1]])
  return int(np.bincount(border, minlength=256).argmax())


def random_affine(im: Image.Image, rng: np.random.Generator, *,
                  shift: float, degrees: float, scale: Tuple[float, float],
                  shear: float) -> Image.Image:
  """:func:`affine_transform` with parameters drawn uniformly from `rng`.

  Draws, in this order, ``dx, dy`` in ``[-shift, shift] x size``, the
  rotation in ``[-degrees, degrees]``, the scale in ``scale`` and the shear in
  ``[-shear, shear]``; fills with :func:`border_mode`. All ranges at their
  identity return `im` itself (no resampling, no draw).
  """
  if not (shift or degrees or shear) and scale[0] == scale[1] == 1.0:
    return im
  w, h = im.size
  u = rng.uniform(-1.0, 1.0, size=2)
  angle = rng.uniform(-degrees, degrees)
  s = rng.uniform(scale[0], scale[1])
  sh = rng.uniform(-shear, shear)
  return affine_transform(im, shift=(u[0] * shift * w, u[1] * shift * h),
                          degrees=angle, scale=s, shear=sh,
                          fill=border_mode(im))


def elastic_distort(x: np.ndarray, rng: np.random.Generator, *, alpha: float,
                    sigma: float, fill: float) -> np.ndarray:
  """A random elastic distortion of a ``[H, W]`` float image (Simard et al.).

  Draws two fields of i.i.d. ``U(-1, 1)`` displacements (x, then y), smooths
  each with a Gaussian of standard deviation ``sigma`` pixels and scales it
  by ``alpha`` pixels; output pixel ``p`` is the input at ``p + d(p)``
  (bilinear; `fill` outside the image). ``alpha = 0`` returns `x` itself
  without a draw.
  """
  if not alpha:
    return x
  from scipy import ndimage  # pylint: disable=g-import-not-at-top
  h, w = x.shape
  d = rng.uniform(-1.0, 1.0, size=(2, h, w))
  dx = ndimage.gaussian_filter(d[0], sigma, mode="constant") * alpha
  dy = ndimage.gaussian_filter(d[1], sigma, mode="constant") * alpha
  yy, xx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  out = ndimage.map_coordinates(x, [yy + dy, xx + dx], order=1,
                                mode="grid-constant", cval=fill)
  return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Preprocess:
  """A preprocessing function ``(bytes, rng) -> float32 [H, W, C]``.

  Build with :func:`get_preprocess`. Instances are immutable and picklable
  (they are sent to multiprocessing workers).

  Attributes:
    preset: 'bninception', 'imagenet' or 'grayscale'.
    train: train (random) or eval (deterministic) variant.
    image_size: output height and width.
    resize_size: eval RGB presets: shorter side before the centre crop.
    scale: train RGB presets: area fraction range of the random crop.
    ratio: train RGB presets: aspect-ratio range of the random crop.
    flip: whether the train variant flips horizontally with probability 1/2.
    affine_shift, affine_degrees, affine_scale, affine_shear: train
      ``grayscale_affine``: the ranges of :func:`random_affine` (identity for
      the other presets).
    elastic_alpha, elastic_sigma: train ``grayscale_affine``: the elastic
      distortion after the affine map (:func:`elastic_distort`; alpha 0:
      off).
  """

  preset: str
  train: bool
  image_size: int
  resize_size: int
  scale: Tuple[float, float]
  ratio: Tuple[float, float]
  flip: bool
  affine_shift: float = 0.0
  affine_degrees: float = 0.0
  affine_scale: Tuple[float, float] = (1.0, 1.0)
  affine_shear: float = 0.0
  elastic_alpha: float = 0.0
  elastic_sigma: float = 4.0

  @property
  def channels(self) -> int:
    return 1 if self.preset in _GRAY else 3

  @property
  def output_shape(self) -> Tuple[int, int, int]:
    return (self.image_size, self.image_size, self.channels)

  def __call__(self, data: bytes, rng: Optional[np.random.Generator] = None,
               where: str = "<image>") -> np.ndarray:
    """Decodes and preprocesses one encoded image.

    Args:
      data: encoded image bytes (JPEG, PNG, ...).
      rng: random generator; required by the train variant.
      where: the image's name, used in error messages.

    Returns:
      float32 array ``[image_size, image_size, channels]``.
    """
    if self.train and rng is None:
      raise ValueError("The train variant of a preset needs `rng` "
                       "(a numpy.random.Generator).")
    size = self.image_size
    if self.preset in _GRAY:
      im = decode(data, "L", where)
      if im.size != (size, size):
        im = im.resize((size, size), Image.BILINEAR)
      if self.train:
        im = random_affine(im, rng, shift=self.affine_shift,
                           degrees=self.affine_degrees,
                           scale=self.affine_scale, shear=self.affine_shear)
      if self.train and self.flip and rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
      x = np.asarray(im, np.float32) * np.float32(1.0 / 255.0)
      if self.train and self.elastic_alpha:
        x = elastic_distort(x, rng, alpha=self.elastic_alpha,
                            sigma=self.elastic_sigma,
                            fill=border_mode(im) / 255.0)
      return x[..., None]
    im = decode(data, "RGB", where)
    if self.train:
      box = random_resized_crop_box(im.size[0], im.size[1], rng,
                                    self.scale, self.ratio)
      im = im.resize((size, size), Image.BILINEAR, box=box)
      if self.flip and rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    else:
      im = center_crop(resize_shorter(im, self.resize_size), size)
    x = np.asarray(im, np.float32)
    if self.preset in RGB_NORMALISATION:
      mean, std = RGB_NORMALISATION[self.preset]
      x = (x * np.float32(1.0 / 255.0) - np.float32(mean)) / np.float32(std)
    else:  # bninception: BGR, 0..255, minus the Caffe mean.
      x = x[..., ::-1] - np.float32(BNINCEPTION_MEAN_BGR)
    return np.ascontiguousarray(x, np.float32)


def get_preprocess(preset: str, *, train: bool, image_size: Optional[int] = None,
                   resize_size: Optional[int] = None,
                   scale: Tuple[float, float] = (0.08, 1.0),
                   ratio: Tuple[float, float] = (3 / 4, 4 / 3),
                   flip: Optional[bool] = None,
                   affine_shift: Optional[float] = None,
                   affine_degrees: Optional[float] = None,
                   affine_scale: Optional[Tuple[float, float]] = None,
                   affine_shear: Optional[float] = None,
                   elastic_alpha: Optional[float] = None,
                   elastic_sigma: Optional[float] = None) -> Preprocess:
  """Returns a preprocessing preset by name.

  Args:
    preset: 'bninception', 'imagenet', 'grayscale' or 'grayscale_affine'.
    train: the random train variant or the deterministic eval variant.
    image_size: output size (default 224 for RGB presets, 28 for grayscale;
      use 227 for the MS/Circle BN-Inception setting, 105 for full-size
      Omniglot).
    resize_size: eval RGB presets: shorter side before the centre crop
      (default 256).
    scale: random-resized-crop area range (default (0.08, 1) as in
      Proxy-Anchor; (0.16, 1) as in Multi-Similarity).
    ratio: random-resized-crop aspect-ratio range.
    flip: random horizontal flip in the train variant (default True for RGB
      presets, False for grayscale: a mirrored character is another glyph).
    affine_shift: ``grayscale_affine`` only: largest shift, a fraction of the
      image size in [0, 0.5] (default 0.1).
    affine_degrees: ``grayscale_affine`` only: largest rotation in degrees,
      in [0, 180] (default 10).
    affine_scale: ``grayscale_affine`` only: scale range ``(min, max)``,
      ``0 < min <= max`` (default (0.9, 1.1)).
    affine_shear: ``grayscale_affine`` only: largest x-shear in degrees, in
      [0, 60] (default 10).
    elastic_alpha: ``grayscale_affine`` only: elastic distortion strength in
      pixels, in [0, 100] (default 0: off; Simard et al. used 34 at 29 px).
    elastic_sigma: ``grayscale_affine`` only: its smoothness in pixels, in
      (0, 20] (default 4, Simard et al.'s).

  Returns:
    A :class:`Preprocess`.

  Raises:
    ValueError: for an unknown preset or invalid sizes/ranges.
  """
  if preset not in PRESETS:
    raise ValueError(f"Unknown preprocessing preset {preset!r}; known presets: "
                     f"{', '.join(PRESETS)}.")
  rgb = preset not in _GRAY
  image_size = int(image_size or (224 if rgb else 28))
  resize_size = int(resize_size or (256 if rgb else image_size))
  if image_size <= 0:
    raise ValueError(f"`image_size` must be positive; got {image_size}.")
  if rgb and resize_size < image_size:
    raise ValueError(f"`resize_size` ({resize_size}) must be >= `image_size` "
                     f"({image_size}) for the centre crop.")
  scale = (float(scale[0]), float(scale[1]))
  ratio = (float(ratio[0]), float(ratio[1]))
  if not 0 < scale[0] <= scale[1] <= 1:
    raise ValueError(f"`scale` must satisfy 0 < min <= max <= 1; got {scale}.")
  if not 0 < ratio[0] <= ratio[1]:
    raise ValueError(f"`ratio` must satisfy 0 < min <= max; got {ratio}.")
  if flip is None:
    flip = rgb
  affine = _affine_ranges(preset, affine_shift=affine_shift,
                          affine_degrees=affine_degrees,
                          affine_scale=affine_scale, affine_shear=affine_shear,
                          elastic_alpha=elastic_alpha,
                          elastic_sigma=elastic_sigma)
  return Preprocess(preset=preset, train=bool(train), image_size=image_size,
                    resize_size=resize_size, scale=scale, ratio=ratio,
                    flip=bool(flip), **affine)


def _affine_ranges(preset: str, **given) -> dict:
  """The checked affine ranges of a preset (identity but for grayscale_affine)."""
  if preset != "grayscale_affine":
    named = sorted(k for k, v in given.items() if v is not None)
    if named:
      raise ValueError(f"{', '.join(named)} only apply to the "
                       f"'grayscale_affine' preset; got preset {preset!r}.")
    return {}
  r = {k: AFFINE_DEFAULTS[k] if v is None else v for k, v in given.items()}
  r = dict(affine_shift=float(r["affine_shift"]),
           affine_degrees=float(r["affine_degrees"]),
           affine_scale=(float(r["affine_scale"][0]),
                         float(r["affine_scale"][1])),
           affine_shear=float(r["affine_shear"]),
           elastic_alpha=float(r["elastic_alpha"]),
           elastic_sigma=float(r["elastic_sigma"]))
  for name, hi in (("affine_shift", 0.5), ("affine_degrees", 180.0),
                   ("affine_shear", 60.0), ("elastic_alpha", 100.0)):
    if not 0.0 <= r[name] <= hi:
      raise ValueError(f"`{name}` must be in [0, {hi:g}]; got {r[name]}.")
  if not 0.0 < r["elastic_sigma"] <= 20.0:
    raise ValueError(f"`elastic_sigma` must be in (0, 20]; got "
                     f"{r['elastic_sigma']}.")
  lo, hi = r["affine_scale"]
  if not 0 < lo <= hi:
    raise ValueError(f"`affine_scale` must satisfy 0 < min <= max; got "
                     f"{r['affine_scale']}.")
  return r
